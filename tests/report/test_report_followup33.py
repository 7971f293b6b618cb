"""``dips report`` after the fixes of review 33 of issue 15: the report counts
``outer_steps.jsonl`` with the rule of ``summary.json`` (a rolled-back step's pushes taken
back, :func:`dips.algo.pushcounts.push_counts`), and shows a cluster's re-join inside one
process (its ``join`` record) and its removal by the leader until then. Inputs are synthetic,
shaped like the review's run2."""

from __future__ import annotations

import json

import pytest

from dips.algo.consumed import tokens_consumed_of
from dips.bench.runreport.build import recorded_figures, write_report
from dips.bench.runreport.files import load_run
from dips.bench.runreport.run_plots import cluster_steps, plot_tokens_per_cluster
from dips.bench.runreport.span import Stretch, down_stretches, run_span
from dips.bench.runreport.timeline import _rows as timeline_rows
from dips.bench.runreport.zoom import DOWN, OPEN
from dips.emu.summary import per_cluster
from dips.spec import ClusterConfig, RunConfig
from tests.report.fixtures import T0, _jsonl, _push
from tests.report.test_report_review33 import _bars

DOWN_LABEL = "down (no process, removed, or follower_down)"

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


def _steps(first: int, t0: float, t1: float) -> list[dict]:
    """Inner steps ``first``, ``first + 1``, ... every 0.5 s from ``t0`` + 0.5 to ``t1``
    (100 tokens each), a sync after every even one."""
    out = []
    for k in range(1, int(2 * (t1 - t0)) + 1):
        s = first + k - 1
        out.append({"step": s, "loss": 5.0, "tokens": 100 * s, "compute_s": 0.3,
                    "time": T0 + t0 + 0.5 * k, **({"push": _push(s // 2, s // 2)}
                                                  if s % 2 == 0 else {})})
    return out


def make_rejoined_run(root):
    """Like review 33's run2 (75 s): cluster b trains and syncs to 20 s, is SIGSTOPped
    there, removed by the leader at 25 s (silent 5.5 s: its last heartbeat came before its
    last step), continued at 68 s (its step in flight ends at 68.2 s), re-joined in the same
    process at 69.75 s (its record at 70 s), trains on;
    cluster c holds from 10.5 s (the leader unreachable), the restarted leader forgets it,
    it re-joins in the same process at 30 s, trains on. Cluster a trains throughout."""
    root.mkdir(parents=True)
    (root / "train_start").write_text(str(T0))
    (root / "summary.json").write_text(json.dumps({"train_time_s": 75.0,
                                                   "cluster_ids": ["a", "b", "c"]}))
    join = {"event": "join", "version": 0, "time": T0}
    _jsonl(root / "outer_steps.jsonl", [_decision(r, r, ["a"]) for r in range(1, 75)])
    _jsonl(root / "clusters" / "a" / "train.jsonl", [{**join, "cluster": "a"},
                                                     *_steps(1, 0.0, 75.0)])
    _jsonl(root / "clusters" / "b" / "train.jsonl", [
        {**join, "cluster": "b"}, *_steps(1, 0.0, 20.0),
        {"step": 41, "loss": 5.0, "tokens": 4100, "compute_s": 0.3, "time": T0 + 68.2},
        {"event": "join", "cluster": "b", "version": 60, "rejoin": True, "time": T0 + 70.0},
        *_steps(42, 70.0, 75.0)])
    _jsonl(root / "clusters" / "c" / "train.jsonl", [
        {**join, "cluster": "c"}, *_steps(1, 0.0, 10.0),
        {"event": "hold", "reason": "leader unreachable", "time": T0 + 10.5},
        {"event": "join", "cluster": "c", "version": 20, "rejoin": True, "time": T0 + 30.0},
        {"event": "hold_end", "reason": "leader unreachable", "held_s": 19.6,
         "time": T0 + 30.1},
        *_steps(21, 30.1, 75.0)])
    _jsonl(root / "leader_events.jsonl", [
        {"time": T0 + 25.0, "event": "cluster_removed", "cluster": "b", "silent_s": 5.5},
        {"time": T0 + 28.0, "event": "leader_resumed", "version": 19},
        {"time": T0 + 29.8, "event": "cluster_joined", "cluster": "c", "rejoin": True},
        {"time": T0 + 69.75, "event": "cluster_joined", "cluster": "b", "rejoin": True}])
    return root


def test_a_removed_cluster_is_down_from_its_last_heartbeat_to_its_rejoin(tmp_path):
    """Review 33 run2, cluster b: SIGSTOPped, removed, back in the same process. It was
    never down in the report (only a process exit made one)."""
    run = load_run(make_rejoined_run(tmp_path / "run"))
    down = down_stretches(run)
    assert down["cluster-b"] == [Stretch(20.0, 69.75)]
    assert "cluster-c" not in down  # held, alive, never removed


def test_the_timeline_shows_a_removal_as_down_and_a_rejoin_in_the_same_process(tmp_path):
    """Review 33 run2: b's row was one inner-steps bar from 20 s to its next sync after the
    re-join (70.5 s), as if it had trained while stopped; c's hold that its re-join ended
    was not drawn at all (only a process exit ended one)."""
    run = load_run(make_rejoined_run(tmp_path / "run"))
    rows = {label: bars for label, bars, _ in timeline_rows(run, run_span(run))}
    b = rows["b"]
    assert b[DOWN] == [(20.0, 49.75)]
    assert not [(s, w) for s, w in b["inner steps"] if s < 69.75 and s + w > 20.0]
    assert any(s >= 69.75 for s, _ in b["inner steps"])  # it trains again after the re-join
    c = rows["c"]
    assert c["held"] == [(10.5, 19.5)] and c[OPEN] == [] and c[DOWN] == []
    rep = write_report(run.root, tmp_path / "out")  # the figure draws them
    whole = next(p for p in rep.plots if p.name == "timeline.png").figure.axes[0]
    labels = [t.get_text() for t in whole.get_yticklabels()]
    assert (DOWN_LABEL, (20.0, 49.75)) in _bars(whole, labels.index("b"))


def test_a_rejoin_in_the_same_process_counts_its_tokens_on(tmp_path):
    """A re-join record between a step's sync_start and its line (the re-join in that
    sync): the same process, so the step counts once (it counted the step twice, as a new
    process's); the loss line breaks there (the model is the pulled one)."""
    recs = [{"event": "join", "cluster": "b", "version": 0, "time": T0},
            *_steps(1, 0.0, 1.5),
            {"event": "sync_start", "inner_step": 4, "tokens": 400, "time": T0 + 1.9},
            {"event": "join", "cluster": "b", "version": 3, "rejoin": True, "time": T0 + 1.95},
            *_steps(4, 1.5, 3.0)]
    assert tokens_consumed_of(recs) == 600
    root = tmp_path / "run"
    _jsonl(root / "clusters" / "b" / "train.jsonl", recs)
    run = load_run(root)
    assert cluster_steps(run, run.clusters["b"]).lifetimes == [0, 3]
