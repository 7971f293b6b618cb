"""``dips report`` after review 26 of issue 15: scores by decision with the leader's restarts
marked (M2), a timeline zoom of at least three complete rounds of every cluster (M4), and the
key figures of a run without ``summary.json`` from the leader's files (M9). Inputs are
synthetic (tests/report/fixtures.py)."""

from __future__ import annotations

import json

import pytest

from dips.bench.runreport.build import recorded_figures, write_report
from dips.bench.runreport.files import load_run
from dips.bench.runreport.round_plots import plot_scores
from dips.bench.runreport.timeline import sync_bars
from dips.bench.runreport.zoom import ZOOM_ROUNDS
from tests.report.fixtures import T0, _jsonl, _push, make_host_copies

pytestmark = pytest.mark.timeout(120)


def _decisions(rounds: list[int]) -> list[dict]:
    return [{"round": r, "version": i + 1, "clusters": ["a", "b"], "accepted": ["a"],
             "rejected": {"b": {"score": 4.0, "reason": "penalty", "code": "penalty"}},
             "scores": {"a": 0.1 * i, "b": 4.0}, "thresholds": {"a": 3.0, "b": 3.0},
             "tokens": {"a": 100, "b": 100}, "time": T0 + i} for i, r in enumerate(rounds)]


def test_scores_are_drawn_by_decision_and_the_leader_restart_is_marked(tmp_path):
    """A restarted leader skips the 64 round numbers it had reserved: by round, rounds 6-69
    were an empty stretch that looked like an outage."""
    recs = _decisions([1, 2, 3, 4, 5, 70, 71, 72])
    plot = plot_scores(recs, restarts=[T0 + 4.5])
    left = plot.figure.axes[0]
    xs = sorted({float(x) for line in left.lines if line.get_label() in ("a", "b")
                 for x in line.get_xdata()})
    assert xs == [float(i) for i in range(1, 9)]  # the n-th decision, from 1 (review 33 m4)
    marks = [line for line in left.lines if line.get_label() == "leader restart"]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == [5.5, 5.5]  # after the 5th
    assert "n-th" in left.get_xlabel() and "from 1" in left.get_xlabel()
    # the run's report takes the restarts from leader_events.jsonl
    _jsonl(tmp_path / "run" / "outer_steps.jsonl", recs)
    _jsonl(tmp_path / "run" / "leader_events.jsonl",
           [{"time": T0 + 4.5, "event": "leader_resumed", "version": 5, "rounds": 69}])
    rep = write_report(tmp_path / "run", tmp_path / "out")
    fig = next(p.figure for p in rep.plots if p.name == "scores.png")
    assert [l.get_label() for l in fig.axes[0].lines].count("leader restart") == 1


def _cluster(root, cid: str, period: float, n: int) -> None:
    steps = [{"event": "join", "cluster": cid, "version": 0, "time": T0}]
    for i in range(1, n + 1):
        steps.append({"step": i, "loss": 5.0, "tokens": 100 * i, "compute_s": period - 0.35,
                      "time": T0 + period * i, "push": _push(i, i)})
    _jsonl(root / "clusters" / cid / "train.jsonl", steps)


def test_the_timeline_zoom_holds_three_complete_rounds_of_every_cluster(tmp_path):
    """Review 26, M4: the zoom was four median inner-step bars (about one round of the fast
    cluster, none of the slow one)."""
    root = tmp_path / "run"
    root.mkdir()
    (root / "train_start").write_text(str(T0))
    _cluster(root, "a", 1.0, 60)
    _cluster(root, "b", 3.0, 20)
    rep = write_report(root, tmp_path / "out")
    fig = next(p.figure for p in rep.plots if p.name == "timeline.png")
    assert len(fig.axes) == 2  # the whole run and the zoom
    lo, hi = fig.axes[1].get_xlim()
    run = load_run(root)
    for cid in ("a", "b"):
        ends = sorted(s + w for s, w in sync_bars(run, run.clusters[cid])["pull"])
        complete = [(s, e) for s, e in zip(ends, ends[1:]) if lo <= s and e <= hi]
        assert len(complete) >= ZOOM_ROUNDS, (cid, lo, hi)
    assert hi - lo < 30.0  # still a zoom of a 60 s run


def test_a_copy_without_summary_json_has_its_key_figures_from_the_leaders_files(tmp_path):
    """Review 26, M9: a run copied from its hosts had no outer steps, no counts, no final
    held-out loss in its report, though the leader's files hold them."""
    root = make_host_copies(tmp_path / "run", named=True)
    leader = root / "host-leader" / "state"
    run = load_run(root)  # no leader.json, no run.json: recounted from outer_steps.jsonl
    figures, used = recorded_figures(run)
    assert figures == {"outer_steps": 3, "updates_pushed": 6, "updates_accepted": 6,
                       "updates_rejected": 0, "tokens_accepted": 1800, "eval_loss_final": 8.3}
    assert used == ["outer_steps.jsonl", "eval.jsonl"]
    (leader / "leader.json").write_text(json.dumps({
        "version": 3, "joined": ["a", "b"], "counts": {
            "outer_steps": 3, "updates_pushed": 7, "updates_accepted": 6,
            "updates_rejected": 1, "tokens_accepted": 1800, "restarts": 1}}))
    (leader / "run.json").write_text(json.dumps({
        "config": {"followers": 2, "inner": {"H": 8}, "clusters": [{"id": "a"}]},
        "eval_loss_initial": 8.31}))
    _jsonl(leader / "eval.jsonl", [{"time": T0 - 5.0, "version": 0, "eval_loss": 8.3},
                                   {"time": T0 + 9.0, "version": 3, "eval_loss": 7.25}])
    figures, used = recorded_figures(load_run(root))
    assert figures == {"outer_steps": 3, "updates_pushed": 7, "updates_accepted": 6,
                       "updates_rejected": 1, "tokens_accepted": 1800, "clusters": 2,
                       "followers": 2, "H": 8, "eval_loss_initial": 8.31,
                       "eval_loss_final": 7.25}
    assert used == ["leader.json", "run.json", "eval.jsonl"]
    page = write_report(root, tmp_path / "out").html.read_text()
    for label, value in (("outer steps", "3"), ("updates pushed", "7"), ("tokens accepted",
                         "1,800"), ("held-out loss, final (nats/token)", "7.25"),
                         ("inner steps per push (H)", "8")):
        assert f"<tr><th>{label}</th><td>{value}</td></tr>" in page, label
    assert "the key figures above come from leader.json, run.json, eval.jsonl" in page
