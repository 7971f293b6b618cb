"""When a run ends (dips.algo.limits, §6: the loop runs while tokens < tks_max)."""

from __future__ import annotations

from dips.algo.limits import stop_reason


def _reason(**kw):
    args = dict(tokens_accepted=0, outer_steps=0, training_s=None, token_budget=None,
                max_outer_steps=None, max_time_s=None)
    return stop_reason(**{**args, **kw})


def test_each_limit_on_its_boundary():
    assert _reason() is None
    assert _reason(tokens_accepted=999, token_budget=1000) is None
    assert _reason(tokens_accepted=1000, token_budget=1000) == "token budget"
    assert _reason(outer_steps=2, max_outer_steps=3) is None
    assert _reason(outer_steps=3, max_outer_steps=3) == "max outer steps"
    assert _reason(training_s=44.9, max_time_s=45.0) is None
    assert _reason(training_s=45.0, max_time_s=45.0) == "max time"


def test_time_counts_only_once_training_began_and_budget_wins_ties():
    assert _reason(training_s=None, max_time_s=1.0) is None
    assert _reason(tokens_accepted=5, outer_steps=9, training_s=99.0, token_budget=5,
                   max_outer_steps=9, max_time_s=1.0) == "token budget"
