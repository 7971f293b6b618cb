"""Calibration: the simulation of a virtual-time scenario lands within 10% of the virtual-time
engine's run (issue 16) on time to the token budget, outer steps and per-cluster idle fraction.

The simulation scenario is built from the virtual one by :func:`dips.sim.calibrate.from_scenario`
(one mapping, so the two cannot drift apart). Two scenarios, small enough for seconds of CPU:
the shape of configs/compare/eta100.yaml (4 clusters, slowdowns 1–2, 10 Gbit links, H = 16,
steps of 1.5 s, grace 0.5 s, update 0.25 s, the paper's transfer / compute ratio) on tiny's
model, and configs/compare/tiny.yaml with a link that drops, a transient slowdown, a 0.5-s
update and FP32 on the wire. The full eta100 comparison is in SCALE.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dips.sim import simulate
from dips.sim.calibrate import figures, from_scenario, ratios, virtual_figures
from dips.spec import Scenario
from dips.spec.scenario import paper_bytes_scale
from tests.sim.helpers import merge

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "dips"
TINY_PARAMS = 34976  # configs/compare/tiny.yaml's model


def _load(name: str, **over) -> Scenario:
    """configs/compare/<name>.yaml with ``over`` merged in depth (lists replaced); listed
    ``clusters`` replace the generated ones."""
    data = yaml.safe_load((ROOT / "configs" / "compare" / f"{name}.yaml").read_text())
    merge(data, {**over, "data": {**over.get("data", {}), "cache_dir": str(CACHE)}})
    if "clusters" in over:
        del data["eta"], data["n_clusters"]
    return Scenario.model_validate(data)


def eta100_shape() -> Scenario:
    """eta100.yaml on tiny's model and data (4 × 16 × 128 tokens per synchronous round, 8 of
    them); the transfer scaled to the paper's 1.98% of a round at 10 Gbit/s, as eta100's."""
    tiny = yaml.safe_load((ROOT / "configs" / "compare" / "tiny.yaml").read_text())
    return _load("eta100", model=tiny["model"], data=tiny["data"],
                 inner={"H": 16, "batch_size": 4, "seq_len": 32}, methods=["di-ps"],
                 token_budget=8 * 4 * 16 * 128, eval_every_tokens=10 ** 9, eval_batches=1,
                 timing={"step_s": 1.5, "latency_s": 0.0, "update_s": 0.25,
                         "model_bytes_scale": paper_bytes_scale(TINY_PARAMS, 16, 1.5)})


def tiny_shaped() -> Scenario:
    """tiny.yaml; c1's link drops from 10 to 1 Gbit/s at 40 s, c2 runs 1.5× slower from 20 to
    60 s, the update takes 0.5 s, FP32 on the wire."""
    clusters = [{"id": "c0", "slowdown": 1.0},
                {"id": "c1", "slowdown": 1.5,
                 "link": {"bps": 1e10, "schedule": [{"at_s": 40.0, "bps": 1e9}]}},
                {"id": "c2", "slowdown": 2.0,
                 "transient": [{"start_s": 20.0, "end_s": 60.0, "factor": 1.5}]}]
    return _load("tiny", clusters=clusters, methods=["di-ps"], token_budget=9216,
                 eval_every_tokens=10 ** 9, eval_batches=1, outer={"wire_dtype": "fp32"},
                 timing={"step_s": 1.5, "model_bytes_scale": 2000.0, "update_s": 0.5})


def test_the_mapping_charges_the_virtual_costs():
    s = eta100_shape()
    sc = from_scenario(s)
    assert sc.H == 16 and sc.wire_bytes_scale == s.timing.model_bytes_scale
    assert [c.slowdown for c in sc.clusters] == [c.slowdown for c in s.clusters]
    assert all(not c.initial_pull and c.stages == 1 and c.uplink.bps == 1e10
               for c in sc.clusters)
    assert sc.leader.grace.window_s == 0.5 and sc.followers.count == s.followers
    assert sc.data.tokens_per_window * sc.clusters[0].windows_per_step == 4 * 32
    no_grace = from_scenario(s, "di-ps-no-grace")
    assert no_grace.leader.grace.window_s == 0.0
    with pytest.raises(ValueError, match="not a Di-PS variant"):
        from_scenario(s, "diloco")


@pytest.mark.parametrize("make", [eta100_shape, tiny_shaped])
def test_simulation_lands_within_10_percent_of_virtual_time(make, tmp_path):
    from dips.emu.virtual import run_dips

    s = make()
    virtual = virtual_figures(run_dips(s, tmp_path / "virtual"))
    sim = figures(simulate(from_scenario(s)))
    assert sim["finished"] == "token budget"
    off = {k: r for k, r in ratios(sim, virtual).items() if abs(r - 1.0) > 0.10}
    assert not off, (off, sim, virtual)
    assert len(sim["idle_frac"]) == len(s.clusters)
