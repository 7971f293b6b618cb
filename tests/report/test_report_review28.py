"""``dips report`` after review 28 of issue 15: a member's records from several files merged by
time, not path (#1); a fault-free timeline zoom whose title says what it shows (#4); the
initial held-out loss drawn without an evaluator (#5). Inputs are synthetic, shaped like the
review's run B (tests/report/fixtures.py)."""

from __future__ import annotations

import pytest

from dips.bench.runreport.build import write_report
from dips.bench.runreport.faults import fault_rows
from dips.bench.runreport.files import by_time, load_run
from dips.bench.runreport.timeline import sync_bars
from dips.bench.runreport.run_plots import cluster_steps, heldout_points
from dips.bench.runreport.zoom import ZOOM_MAX_FRACTION, ZOOM_ROUNDS, rounds_of, zoom_window
from tests.report.fixtures import T0, _jsonl, make_outage_run

pytestmark = pytest.mark.timeout(120)


def _lifetime(first: int, n: int, t0: float, loss0: float, dloss: float) -> list[dict]:
    return [{"step": s, "loss": loss0 - dloss * (s - first), "tokens": 256 * (s - first + 1),
             "compute_s": 0.04, "time": t0 + 0.1 * (s - first + 1)} for s in range(first, first + n)]


def make_restarted_on_another_host(root):
    """Cluster c's first process (steps 1-40, loss 6.2 -> 4.6) on host ``c-site-z``; after a
    kill it resumed from its step-32 checkpoint on host ``c-site-a`` (steps 33-60, loss 4.5 ->
    4.3): the second lifetime's path sorts first (review 28 #1)."""
    leader = root / "hosts" / "leader" / "state"
    leader.mkdir(parents=True)
    (leader / "train_start").write_text(str(T0))
    _jsonl(leader / "leader_events.jsonl", [
        {"time": T0, "event": "cluster_joined", "cluster": "c", "rejoin": False, "version": 0}])
    _jsonl(root / "hosts" / "c-site-z" / "state" / "train.jsonl",
           [{"event": "join", "cluster": "c", "version": 0, "time": T0}]
           + _lifetime(1, 40, T0, 6.2, 0.04))
    _jsonl(root / "hosts" / "c-site-a" / "state" / "train.jsonl",
           [{"event": "join", "cluster": "c", "version": 9, "time": T0 + 20.0},
            {"event": "resume", "version": 7, "saved_step": 32.0, "steps": 32, "tokens": 8192,
             "time": T0 + 20.0}]
           + _lifetime(33, 28, T0 + 20.0, 4.5, 0.007))
    return root


def test_a_clusters_lifetimes_from_two_hosts_are_merged_by_time_not_path(tmp_path):
    """Path order put c's second lifetime first: drawn at 0-7k tokens, its first after it,
    and c labelled "(diverged)" (its last smoothed loss above its first)."""
    run = load_run(make_restarted_on_another_host(tmp_path / "run"))
    recs = run.clusters["c"]
    times = [r["time"] for r in recs]
    assert times == sorted(times)
    assert recs[0]["version"] == 0 and [r.get("step") for r in recs if "step" in r][:2] == [1, 2]
    steps = cluster_steps(run, recs)
    assert steps.lifetimes == [0, 40]
    assert steps.loss[0] == pytest.approx(6.2) and steps.loss[-1] < 4.4
    assert steps.tokens == sorted(steps.tokens)
    assert any("merged by time" in n for n in run.notes)
    rep = write_report(tmp_path / "run", tmp_path / "out")
    for name in ("loss_vs_time.png", "loss_vs_tokens.png"):
        plot = next(p for p in rep.plots if p.name == name)
        labels = [line.get_label() for ax in plot.figure.axes for line in ax.lines]
        assert not any("diverged" in lb for lb in labels), (name, labels)
        assert "diverged" not in (plot.note or ""), name


def test_by_time_keeps_untimed_records_with_their_predecessor():
    a = [{"x": 1, "time": 5.0}, {"x": 2}, {"x": 3, "time": 7.0}]
    b = [{"y": 1}, {"y": 2, "time": 6.0}]
    assert [r["x"] if "x" in r else 10 * r["y"] for r in by_time([a, b])] == [10, 1, 2, 20, 3]
    assert by_time([a]) == a


def test_the_timeline_zoom_is_a_fault_free_stretch_and_its_title_says_what_it_holds(tmp_path):
    """Review 28 #4: with dense faults the zoom covered half the run, a leader outage (20-61 s
    here) included, under a title claiming "at least 3 rounds of every cluster"."""
    root = make_outage_run(tmp_path / "run")
    quiet = set(range(5, 13))  # the only stretch without fault records
    _jsonl(root / "leader_events.jsonl", [
        {"time": T0 + t + 0.1, "event": "follower_down" if t % 2 else "follower_up",
         "follower": 0, "silent_s": 1.0, "restarted": True}
        for t in [*range(1, 21), *range(61, 81)] if t not in quiet])
    run = load_run(root)
    faults = [r.time_s for r in fault_rows(run)]
    assert len(faults) > 20
    rep = write_report(root, tmp_path / "out")
    fig = next(p.figure for p in rep.plots if p.name == "timeline.png")
    lo, hi = fig.axes[1].get_xlim()
    span = fig.axes[0].get_xlim()[1]
    assert hi - lo <= ZOOM_MAX_FRACTION * span + 1e-9
    assert not any(lo <= t <= hi for t in faults), (lo, hi)
    assert hi <= 20.35 or lo >= 61.35, (lo, hi)  # not in the leader's outage
    title = fig.axes[1].get_title()
    assert "no fault or outage in it" in title and "at least" not in title
    rows = {c: sync_bars(run, r) for c, r in run.clusters.items()}
    complete = sum(1 for s, e in rounds_of(rows["a"]) if lo <= s and e <= hi)
    assert f"a {complete}" in title and complete >= ZOOM_ROUNDS


def test_a_zoom_with_no_clean_stretch_says_so():
    """Faults every 0.5 s: no stretch is free of them; the title counts what is in it."""
    leader = {"update": [(t + 0.9, 0.05) for t in range(40)]}
    rows = {"a": {"inner steps": [(t + 0.0, 0.8) for t in range(40)], "held": [],
                  "push": [(t + 0.8, 0.05) for t in range(40)],
                  "wait": [(t + 0.85, 0.1) for t in range(40)],
                  "pull": [(t + 0.95, 0.05) for t in range(40)]}}
    zoom = zoom_window(leader, rows, 40.0, [0.5 * i for i in range(80)])
    assert zoom.faults > 0 and zoom.hi - zoom.lo <= 10.0
    assert "no stretch this wide is free of them" in zoom.title()


def test_without_summary_or_evaluator_the_initial_heldout_loss_is_drawn_at_0(tmp_path):
    """Review 28 #5: a run in progress without an evaluator: the key figures showed the
    initial held-out loss from run.json, loss_vs_time.png drew no held-out point."""
    root = make_outage_run(tmp_path / "run")
    (root / "run.json").write_text('{"eval_loss_initial": 8.353, "config": {}}')
    run = load_run(root)
    assert heldout_points(run) == [(0.0, 0.0, 8.353)]
    rep = write_report(root, tmp_path / "out")
    fig = next(p.figure for p in rep.plots if p.name == "loss_vs_time.png")
    held = [ln for ln in fig.axes[0].lines if ln.get_label() == "global model, held-out"]
    assert len(held) == 1 and list(held[0].get_ydata()) == [8.353]
