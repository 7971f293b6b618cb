"""``dips report`` on runs as an operator meets them (review 15, #4 and #10): a run copied
from its hosts whose state directories share a name, a cluster whose process died and
restarted, a run with a long outage in its middle. Inputs are synthetic
(tests/report/fixtures.py)."""

from __future__ import annotations

import json
import math

import pytest

from dips.bench.runreport.build import write_report
from dips.bench.runreport.files import load_run
from dips.bench.runreport.timeline import sync_bars
from dips.bench.runreport.run_plots import cluster_steps, heldout_points
from tests.report.fixtures import T0, make_host_copies, make_multihost_run, make_outage_run


@pytest.mark.parametrize("named", [True, False])
def test_host_copies_stay_apart_and_the_time_axis_is_the_runs(tmp_path, named):
    """Every host's state directory is ``state``: the followers' (and the clusters') files
    were merged into one "state" member, and the time axis counted from the leader's start-up,
    30 s before the training."""
    run = load_run(make_host_copies(tmp_path / "run", named))
    if named:  # the files say whose they are
        assert sorted(run.clusters) == ["a", "b"] and sorted(run.followers) == ["0", "1"]
    else:  # older files: their folders, as far up as it takes to tell them apart
        assert sorted(run.clusters) == ["east/state", "west/state"]
        assert sorted(run.followers) == ["host-f0/state", "host-f1/state"]
    assert all(len(recs) == 3 for recs in run.followers.values())
    assert run.origin() == T0  # the first cluster_joined, as dips launch's train_start
    assert [round(t, 6) for t, _, _ in heldout_points(run)] == [0.0]  # v0, not at -5 s
    for recs in run.clusters.values():
        bars = sync_bars(run, recs)
        assert min(s for b in bars.values() for s, _ in b) >= 0.0
    rep = write_report(tmp_path / "run", tmp_path / "out")
    assert next(p for p in rep.plots if p.name == "followers.png").series == 2
    assert next(p for p in rep.plots if p.name == "loss_vs_time.png").series == 3


def test_a_loss_line_breaks_where_a_clusters_process_restarted(tmp_path):
    """site-a's process died after 6 steps and a new one joined: the line went on across."""
    run = load_run(make_multihost_run(tmp_path / "run"))
    steps = cluster_steps(run, run.clusters["site-a"])
    assert steps.lifetimes == [0, 6]
    xs, ys = steps.lines(steps.time_s, 1)
    assert len(xs) == 9 and math.isnan(xs[6]) and math.isnan(ys[6])
    assert ys[:6] == pytest.approx(steps.loss[:6]) and ys[7:] == pytest.approx(steps.loss[6:])
    rep = write_report(tmp_path / "run", tmp_path / "out")
    for name in ("loss_vs_time.png", "loss_vs_tokens.png"):
        fig = next(p.figure for p in rep.plots if p.name == name)
        line = next(l for l in fig.axes[0].lines if l.get_label().startswith("site-a"))
        assert sum(math.isnan(x) for x in line.get_xdata()) == 1, name


def test_the_timeline_zoom_shows_rounds_not_the_outage_in_the_middle(tmp_path):
    """A 40 s outage in the middle of an 80 s run: the zoom (4 inner-step periods around the
    middle) showed an empty stretch."""
    rep = write_report(make_outage_run(tmp_path / "run"), tmp_path / "out")
    fig = next(p.figure for p in rep.plots if p.name == "timeline.png")
    lo, hi = fig.axes[1].get_xlim()
    assert hi - lo < 10.0
    rounds = [t + 0.3 for t in [*range(1, 21), *range(61, 81)]]
    assert sum(lo <= t <= hi for t in rounds) >= 2, (lo, hi)


def test_a_hold_is_drawn_as_held_and_not_as_inner_steps(tmp_path):
    """Review 15, #2: a cluster that could not sync held its training; the timeline showed
    the hold as inner steps up to the push that ended it."""
    run_dir = make_outage_run(tmp_path / "run")
    path = run_dir / "clusters" / "a" / "train.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    at = next(i for i, r in enumerate(recs) if r.get("step") == 21)  # the first after the outage
    sync = recs[at]
    recs[at:at + 1] = [{"event": "hold", "reason": "sync overdue", "time": T0 + 21.0},
                       {"event": "hold_end", "held_s": 40.0, "time": sync["time"],
                        "push": sync.pop("push")}, sync]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = load_run(run_dir)
    bars = sync_bars(run, run.clusters["a"])
    assert bars["held"] == [(21.0, 40.5)]
    assert not [b for b in bars["inner steps"] if b[0] < 60.0 and b[0] + b[1] > 21.0 + 1e-9]
