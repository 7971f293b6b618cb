"""Calibration against a real run: the simulation of the demo, with the costs measured in a
real ``dips launch`` of it, lands within 10% of that run (issue 16; SCALE.md).

The real run is not repeated here (its figures depend on the machine's load): ``make
calibrate-real`` ran configs/quickstart.yaml for 150 s of training, measured its costs and
figures (:func:`dips.sim.realrun.measure`) and recorded them in tests/sim/data/real_demo.json.
The test maps that record to a simulation (:func:`dips.sim.realrun.from_real`: each cluster's
measured step time, its measured push and pull seconds, the leader's measured update phase)
and compares, for the mean of :data:`SEEDS` seeds of the simulation's step-time noise (one
seed is one draw of it: its outer steps vary by ±7%), the time to the real run's accepted
tokens, the outer steps and the idle fraction of all clusters together within 10%, and each
cluster's idle fraction within 25% (one 150-s run holds 3–7 syncs per cluster, and whether a
push falls into another cluster's grace window, which saves up to its 1-s wait, is a matter of
a few draws: SCALE.md gives the figures and why the 2-stage cluster idles less in the real
runs).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from dips.sim import simulate
from dips.sim.calibrate import figures, ratios
from dips.sim.realrun import from_real, real_figures

pytestmark = pytest.mark.timeout(120)
FIXTURE = Path(__file__).parent / "data" / "real_demo.json"
SEEDS = range(8)


def _load() -> dict:
    return json.loads(FIXTURE.read_text())


def test_the_mapping_charges_the_measured_costs():
    doc = _load()
    sc = from_real(doc)
    assert sc.token_budget == doc["real"]["tokens_accepted"] and sc.H == doc["run"]["inner"]["H"]
    for c in sc.clusters:
        m = doc["clusters"][c.id]
        assert c.step_s == m["step_s_mean"] and c.stages == m["stages"] and c.join_s == m["join_s"]
        assert c.uplink.bps == pytest.approx(2 * doc["params"] * 8 / m["push_s_mean"])
    largest_update = sc.followers.update_s_per_param * doc["params"]
    assert largest_update == pytest.approx(doc["update_s_mean"])
    assert sc.followers.apply == "sequential" and sc.leader.grace.window_s == 1.0
    with pytest.raises(ValueError, match="transfers"):
        from_real(doc, "guess")


def test_the_simulation_lands_within_10_percent_of_the_real_run():
    doc = _load()
    real = real_figures(doc)
    runs = [figures(simulate(from_real(doc, seed=s))) for s in SEEDS]
    assert all(r["finished"] == "token budget" for r in runs)
    mean = {k: statistics.mean(ratios(r, real)[k] for r in runs) for k in ratios(runs[0], real)}
    sim_idle = statistics.mean(sum(r["idle_frac"].values()) for r in runs)
    mean["idle_frac.all"] = sim_idle / sum(real["idle_frac"].values())
    close = {k: mean[k] for k in ("time_s", "outer_steps", "idle_frac.all")}
    assert all(abs(r - 1.0) <= 0.10 for r in close.values()), mean
    per_cluster = {k: r for k, r in mean.items() if k.startswith("idle_frac.c")}
    assert len(per_cluster) == len(doc["clusters"])
    assert all(abs(r - 1.0) <= 0.25 for r in per_cluster.values()), mean


def test_bench_dataplane_transfer_costs_give_the_same_figures():
    """With bench_transfer's cost per byte (2.1 ms per push, against the 31–59 ms measured per
    push in the run) the figures move by less than 5%: the 1-s grace window, not the transfer,
    is the clusters' wait here."""
    doc = _load()
    for s in SEEDS[:2]:
        run = figures(simulate(from_real(doc, "run", seed=s)))
        bench = figures(simulate(from_real(doc, "bench", seed=s)))
        assert bench["outer_steps"] == run["outer_steps"]
        assert bench["time_s"] == pytest.approx(run["time_s"], rel=0.05)
        assert sum(bench["idle_frac"].values()) == pytest.approx(sum(run["idle_frac"].values()),
                                                                 rel=0.05)
