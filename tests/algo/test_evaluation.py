"""The periodic evaluator's pure rules (issue 15, :mod:`dips.algo.evaluation`): which version
is due, the back-off after a failed pull, and each refusal of a held-out report by name."""

from __future__ import annotations

import math

import pytest

from dips.algo.evaluation import (
    EvalReport,
    Schedule,
    admit_report,
    check_report,
    due,
    next_due,
    perplexity,
    record,
    retry_delay,
    tokens_at,
)
from dips.algo.refusal import Refusal, Refused

pytestmark = pytest.mark.timeout(30)


def test_a_version_is_due_at_each_multiple_of_every_after_the_last():
    assert next_due(None, 4) == 0 and next_due(0, 4) == 4 and next_due(5, 4) == 8
    assert due(0, 4, None) and due(7, 4, None)  # the first look takes whatever is current
    assert not due(3, 4, 0) and due(4, 4, 0) and due(6, 4, 0)  # behind: the newest
    assert not due(7, 4, 6) and due(8, 4, 6)
    assert due(1, 1, 0) and not due(1, 1, 1)
    with pytest.raises(ValueError, match="every = 0"):
        next_due(None, 0)


def test_the_final_version_is_due_whatever_every_but_never_one_already_evaluated():
    assert due(5, 4, 4, finished=True) and not due(5, 4, 4)
    assert not due(4, 4, 4, finished=True)
    assert not due(3, 4, 4, finished=True)  # rolled back below the last one evaluated


def test_retry_delay_doubles_from_half_a_second_to_its_cap():
    assert [retry_delay(n) for n in range(8)] == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0]
    assert retry_delay(10**6) == 30.0 and retry_delay(3, base_s=1.0, cap_s=3.0) == 3.0


def test_the_schedule_waits_for_ready_followers_and_backs_off_after_a_failed_pull():
    s = Schedule(every=2)
    assert s.target(0, False, ready=False, now=0.0) is None  # a follower down: no pull
    assert s.target(0, False, ready=True, now=0.0) == 0
    assert s.failed(now=10.0) == 0.5 and s.failed(now=10.0) == 1.0
    assert s.target(1, False, True, now=10.5) is None  # still backing off
    assert s.target(1, False, True, now=11.0) == 1  # the newest version, not the failed one
    s.done(1)
    assert (s.last, s.failures, s.not_before) == (1, 0, 0.0)
    assert s.target(1, False, True, 20.0) is None and s.target(2, False, True, 20.0) == 2
    s.done(0)  # an older one settled late never moves it back
    assert s.last == 1
    with pytest.raises(ValueError):
        Schedule(every=0)


@pytest.mark.parametrize("report, field, value", [
    (EvalReport(3, math.nan, 100), "eval_loss", "nan"),
    (EvalReport(3, math.inf, 100), "eval_loss", "inf"),
    (EvalReport(3, -0.5, 100), "eval_loss", "-0.5"),
    (EvalReport(3, 5.0, 0), "eval_tokens", "0"),
    (EvalReport(-1, 5.0, 100), "version", "-1"),
])
def test_a_malformed_report_is_refused_naming_the_field_and_value(report, field, value):
    with pytest.raises(Refused) as info:
        check_report(report)
    assert info.value.code is Refusal.INVALID_ARGUMENT
    assert f"field {field!r} = {value}" in info.value.message


def test_the_leader_refuses_a_version_in_the_future_repeated_or_older():
    ok = EvalReport(4, 5.5, 4032)
    assert admit_report(ok, leader_version=4, last_reported=2) is ok
    assert admit_report(EvalReport(0, 8.3, 10), 0, None).version == 0
    cases = [(EvalReport(5, 5.5, 10), 4, None, "'version' = 5: in the future"),
             (EvalReport(2, 5.5, 10), 4, 2, "'version' = 2: repeated"),
             (EvalReport(1, 5.5, 10), 4, 2, "'version' = 1: older than the last report"),
             (EvalReport(1, math.nan, 10), 4, None, "'eval_loss' = nan")]
    for report, version, last, says in cases:
        with pytest.raises(Refused) as info:
            admit_report(report, version, last)
        assert info.value.code is Refusal.INVALID_ARGUMENT and says in info.value.message


def test_tokens_at_a_version_subtract_the_later_versions_tokens():
    stats = {3: (1, 100), 4: (2, 300), 5: (1, 50)}
    assert tokens_at(5, 5, 1000, stats) == 1000
    assert tokens_at(3, 5, 1000, stats) == 650
    assert tokens_at(2, 5, 1000, stats) == 550
    assert tokens_at(1, 5, 1000, stats) is None  # version 2's tokens are not kept
    assert tokens_at(6, 5, 1000, stats) is None


def test_the_record_holds_perplexity_and_null_where_it_overflows():
    rec = record(EvalReport(4, 2.0, 4032), 16384, now=1767000000.1234)
    assert rec == {"time": 1767000000.123, "version": 4, "tokens_accepted": 16384,
                   "eval_loss": 2.0, "perplexity": math.exp(2.0), "eval_tokens": 4032}
    diverged = record(EvalReport(4, 11719.0, 10), None, now=0.0)
    assert diverged["perplexity"] is None and perplexity(11719.0) == math.inf
