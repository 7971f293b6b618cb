"""``dips report`` after the fixes of review 33 of issue 15: the report counts
``outer_steps.jsonl`` with the rule of ``summary.json`` (a rolled-back step's pushes taken
back, :func:`dips.algo.pushcounts.push_counts`), and shows a cluster's re-join inside one
process (its ``join`` record) and its removal by the leader until then. Inputs are synthetic,
shaped like the review's run2."""

from __future__ import annotations

import json

import pytest

from dips.bench.runreport.build import recorded_figures
from dips.bench.runreport.files import load_run
from dips.bench.runreport.run_plots import plot_tokens_per_cluster
from dips.emu.summary import per_cluster
from dips.spec import ClusterConfig, RunConfig
from tests.report.fixtures import T0, _jsonl

pytestmark = pytest.mark.timeout(120)


def _decision(rnd: int, version: int, accepted: list[str], rejected: tuple[str, ...] = ()):
    pushed = [*accepted, *rejected]
    return {"round": rnd, "version": version, "clusters": pushed, "accepted": accepted,
            "rejected": {c: {"reason": "penalty", "code": "penalty"} for c in rejected},
            "scores": {}, "tokens": dict.fromkeys(pushed, 100), "time": T0 + rnd}


def make_rolled_back_run(root):
    """v1 and v2 accept a and b; the followers are reconciled to v1 (a ``rollback`` line:
    v2 lost); round 3 makes v2 again, accepting a only (b rejected)."""
    root.mkdir(parents=True)
    (root / "train_start").write_text(str(T0))
    _jsonl(root / "outer_steps.jsonl", [
        _decision(1, 1, ["a", "b"]), _decision(2, 2, ["a", "b"]),
        {"event": "rollback", "version": 1, "lost": 1, "time": T0 + 2.5},
        _decision(3, 2, ["a"], rejected=("b",))])
    return root


def test_tokens_per_cluster_takes_a_rolled_back_step_back_as_the_summary_does(tmp_path):
    """The plot added every decision line's accepted tokens (a 300, b 200): the rolled-back
    v2 counted with the v2 decided after it. summary.json's per_cluster says a 200, b 100."""
    root = make_rolled_back_run(tmp_path / "run")
    summary = per_cluster(root, RunConfig(clusters=[ClusterConfig(id="a"),
                                                    ClusterConfig(id="b")]))
    assert {c: row["tokens_accepted"] for c, row in summary.items()} == {"a": 200, "b": 100}
    plot = plot_tokens_per_cluster(load_run(root))
    bars = [p.get_height() for p in plot.figure.axes[0].patches]
    assert bars == [200.0, 100.0]


def test_the_recounted_key_figures_take_a_rolled_back_step_back(tmp_path):
    """Without summary.json and leader.json the key figures were recounted with every
    rolled-back step in (3 outer steps, 5 accepted, 500 tokens); the leader's counts say
    2 outer steps, 3 accepted, 300 tokens."""
    figures, used = recorded_figures(load_run(make_rolled_back_run(tmp_path / "run")))
    assert figures == {"outer_steps": 2, "updates_pushed": 6, "updates_accepted": 3,
                       "updates_rejected": 1, "tokens_accepted": 300}
    assert used == ["outer_steps.jsonl"]
