"""``dips report`` after review 33 of issue 15: every figure with a time axis spans the whole
run, draws open holds and outages to its end, marked open, and shows follower outages (M2);
the timeline's legend entries each have a colour of their own (m7); the held-out series says
which versions it holds (m6). Inputs are synthetic, shaped like the review's run2."""

from __future__ import annotations

import json

import pytest
from matplotlib.collections import PolyCollection
from matplotlib.lines import Line2D

from dips.bench.runreport.build import write_report
from dips.bench.runreport.files import load_run
from dips.bench.runreport.span import Stretch, down_stretches, run_span
from dips.bench.runreport.timeline import sync_bars
from dips.bench.runreport.zoom import OPEN
from tests.report.fixtures import T0, _jsonl, _push

pytestmark = pytest.mark.timeout(120)


def _syncs(cid: str, until: float) -> list[dict]:
    """Join at 0, an inner step every 0.5 s, a sync every second step, to ``until`` s."""
    recs: list[dict] = [{"event": "join", "cluster": cid, "version": 0, "time": T0}]
    for i in range(1, int(2 * until) + 1):
        recs.append({"step": i, "loss": 5.0, "tokens": 100 * i, "compute_s": 0.3,
                     "time": T0 + 0.5 * i, **({"push": _push(i // 2, i // 2)} if i % 2 == 0
                                              else {})})
    return recs


def make_stalled_run(root):
    """Rounds to 8 s; cluster a killed at 12 s and never back; b holding from 9 s until its
    process is stopped at the shutdown (35 s); c held from 5 s, killed at 6 s, re-joined at
    7 s; follower 0 down 15-25 s, follower 1 down from 20 s to the end; the stop at 30 s
    (max time), the run's last record at 36 s."""
    root.mkdir(parents=True)
    (root / "train_start").write_text(str(T0))
    (root / "summary.json").write_text(json.dumps({"train_time_s": 30.0, "cluster_ids": ["a", "b", "c"]}))
    _jsonl(root / "outer_steps.jsonl", [
        {"round": r, "version": r, "clusters": ["a", "b"], "accepted": ["a", "b"], "rejected": {},
         "scores": {}, "tokens": {"a": 100, "b": 100}, "base_versions": {"a": r - 1, "b": r - 1},
         "window_s": 0.3, "push_s": 0.1, "update_s": 0.05, "time": T0 + r + 0.05}
        for r in range(1, 9)])
    _jsonl(root / "clusters" / "a" / "train.jsonl", _syncs("a", 8.0))
    _jsonl(root / "clusters" / "b" / "train.jsonl", _syncs("b", 8.0) + [
        {"event": "hold", "reason": "sync overdue", "time": T0 + 9.0}])
    _jsonl(root / "clusters" / "c" / "train.jsonl", _syncs("c", 4.0) + [
        {"event": "hold", "reason": "sync overdue", "time": T0 + 5.0},
        {"event": "join", "cluster": "c", "version": 4, "time": T0 + 7.0},
        {"step": 9, "loss": 5.0, "tokens": 900, "compute_s": 0.3, "time": T0 + 7.5}])
    for f in (0, 1):
        _jsonl(root / "followers" / str(f) / "applied.jsonl", [
            {"version": v, "round": v, "accepted": ["a", "b"], "follower": f, "time": T0 + v,
             "busy_s": {"update": 0.05, "push": 0.1, "pull": 0.05}, "span_s": 1.0}
            for v in range(1, 9)])
    _jsonl(root / "leader_events.jsonl", [
        {"time": T0 + 15.0, "event": "follower_down", "follower": 0, "silent_s": 1.5},
        {"time": T0 + 20.0, "event": "follower_down", "follower": 1, "silent_s": 1.5},
        {"time": T0 + 25.0, "event": "follower_up", "follower": 0, "restarted": True}])
    _jsonl(root / "events.jsonl", [
        {"time": T0 + 6.0, "event": "exited", "process": "cluster-c", "returncode": -9},
        {"time": T0 + 6.1, "event": "restart", "process": "cluster-c"},
        {"time": T0 + 12.0, "event": "exited", "process": "cluster-a", "returncode": -9},
        {"time": T0 + 12.1, "event": "restart", "process": "cluster-a"},
        {"time": T0 + 30.0, "event": "stop", "process": "launcher", "reason": "max time"},
        {"time": T0 + 35.0, "event": "stopped", "process": "cluster-b", "returncode": 0},
        {"time": T0 + 36.0, "event": "stopped", "process": "leader", "returncode": 0}])
    return root


def test_the_runs_span_and_who_was_down(tmp_path):
    run = load_run(make_stalled_run(tmp_path / "run"))
    span = run_span(run)
    assert (span.end, span.stop, span.stop_reason) == (36.0, 30.0, "max time")
    assert down_stretches(run, span) == {
        "cluster-a": [Stretch(12.0, 36.0, open=True)],  # never back
        "cluster-c": [Stretch(6.0, 7.0)],  # back at its join
        "follower-0": [Stretch(15.0, 25.0)],
        "follower-1": [Stretch(20.0, 36.0, open=True)]}


def test_a_hold_no_record_ends_is_drawn_to_its_process_end(tmp_path):
    """Review 33 M2: b held from 9 s to the end of the run, alive; its row ended at 9 s, as
    the killed clusters' rows did. A hold cut by its process's death (c) was not drawn."""
    run = load_run(make_stalled_run(tmp_path / "run"))
    b = sync_bars(run, run.clusters["b"], "b")
    assert b["held"] == [(9.0, 26.0)] and b[OPEN] == [(9.0, 26.0)]  # holding at the shutdown
    c = sync_bars(run, run.clusters["c"], "c")
    assert c["held"] == [(5.0, 1.0)] and c[OPEN] == []  # ended by its process's exit


def _bars(ax, y: int) -> list[tuple[str, tuple[float, float]]]:
    """(label, (start, width)) of every bar of row ``y`` of a timeline axes."""
    out = []
    for coll in ax.collections:
        if isinstance(coll, PolyCollection):
            for path in coll.get_paths():
                (x0, y0), (x1, y1) = path.vertices.min(axis=0), path.vertices.max(axis=0)
                if y0 < y < y1:
                    out.append((coll.get_label(), (round(float(x0), 6), round(float(x1 - x0), 6))))
    return out


def test_every_time_axis_spans_the_run_and_shows_the_outages(tmp_path):
    """Review 33 M2: the timeline ended at the last round (8 s here) and followers.png at the
    followers' last applied record: the stall and every follower outage were in no figure."""
    rep = write_report(make_stalled_run(tmp_path / "run"), tmp_path / "out")
    plots = {p.name: p for p in rep.plots}
    whole = plots["timeline.png"].figure.axes[0]
    assert whole.get_xlim() == (0.0, 36.0)
    rows = [t.get_text() for t in whole.get_yticklabels()]
    assert rows == ["leader", "a", "b", "c", "follower-0", "follower-1"]
    a = _bars(whole, rows.index("a"))  # killed at 12 s, never back: down to the end, open
    assert ("down (no process, removed, or follower_down)", (12.0, 24.0)) in a
    assert ("open: no record ends it", (12.0, 24.0)) in a
    b = _bars(whole, rows.index("b"))  # holding from 9 s to its process's stop: open
    assert ("held", (9.0, 26.0)) in b and [w for _, w in b].count((9.0, 26.0)) == 2
    f1 = _bars(whole, rows.index("follower-1"))
    assert {w for _, w in f1} == {(20.0, 16.0)} and len(f1) == 2  # down, and marked open
    stops = [ln for ln in whole.lines if ln.get_label().startswith("training stopped (max time)")]
    assert len(stops) == 1 and list(stops[0].get_xdata()) == [30.0, 30.0]
    for ax in plots["followers.png"].figure.axes:
        assert ax.get_xlim() == (0.0, 36.0)
    f0, f1 = plots["followers.png"].figure.axes
    assert f0.get_title().endswith("; down 15-25 s") and f1.get_title().endswith("; down 20-36 s (open)")
    assert "down" in f0.get_legend_handles_labels()[1]
    assert "down, open: no record ends it" in f1.get_legend_handles_labels()[1]
    assert "applied.jsonl records end at 8.0 s (follower 0)" in plots["followers.png"].note
    assert plots["loss_vs_time.png"].figure.axes[0].get_xlim() == (0.0, 36.0)


def _colour(handle) -> tuple:
    if isinstance(handle, Line2D):
        return ("line", handle.get_color(), handle.get_linestyle())
    return ("fill", tuple(handle.get_facecolor()[0]), handle.get_hatch())


def test_every_timeline_legend_entry_has_a_colour_of_its_own(tmp_path):
    """Review 33 m7: the leader's "push phase" and a cluster's "push" were both #e6550d."""
    rep = write_report(make_stalled_run(tmp_path / "run"), tmp_path / "out")
    ax = next(p for p in rep.plots if p.name == "timeline.png").figure.axes[0]
    handles, labels = ax.get_legend_handles_labels()
    assert {"push phase", "push", "held", "down (no process, removed, or follower_down)"} <= set(labels)
    looks = [_colour(h) for h in handles]
    assert len(set(looks)) == len(looks), dict(zip(labels, looks))


def _evals(root, versions: list[int], final: int) -> None:
    root.mkdir(parents=True)
    (root / "train_start").write_text(str(T0))
    (root / "run.json").write_text(json.dumps({"config": {"evaluate": {"every": 4}},
                                               "eval_loss_initial": 6.3}))
    (root / "summary.json").write_text(json.dumps({"final_version": final, "train_time_s": 50.0,
                                                   "eval_loss_initial": 6.3}))
    _jsonl(root / "eval.jsonl", [{"time": T0 + v, "version": v, "tokens_accepted": 100 * v,
                                  "eval_loss": 6.0 - 0.01 * v} for v in versions])


def test_the_heldout_series_says_which_versions_it_holds(tmp_path):
    """Review 33 m6: after a leader outage the series had 25 instead of 24, and an evaluator
    started late had no version 0, with nothing saying so."""
    _evals(tmp_path / "outage", [0, 4, 8, 12, 16, 20, 25, 28, 32, 33], final=33)
    note = next(p for p in write_report(tmp_path / "outage", tmp_path / "o1").plots
                if p.name == "loss_vs_time.png").note
    assert "10 evaluations by dips evaluate (eval.jsonl) of versions 0 to 33" in note
    assert "each multiple of 4 the evaluator could pull, and the final version" in note
    assert "due but not evaluated: 24;" in note
    assert "evaluated instead, off the multiples of 4: 25;" in note
    assert "33 is the final version" in note
    _evals(tmp_path / "late", [3, 4, 8, 12], final=12)
    note = next(p for p in write_report(tmp_path / "late", tmp_path / "o2").plots
                if p.name == "loss_vs_time.png").note
    assert "due but not" not in note and "off the multiples" not in note
    assert ("the evaluator's first look was at version 3 (the point at 0 s is the initial "
            "model's eval_loss_initial)") in note
