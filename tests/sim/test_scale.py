"""Projections (dips.sim.scale): the base scenarios scale to N clusters in their proportions."""

from __future__ import annotations

from pathlib import Path

import pytest

from dips.sim import simulate
from dips.sim.costs import layer_params, memory_bytes
from dips.sim.scale import _row, plot_load, scaled, table
from dips.spec.simulate import load_sim_scenario

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("model, params", [("100b", 102_543_925_248), ("14b", 14_768_307_200)])
def test_bases_scale_in_proportion(model, params):
    base = load_sim_scenario(ROOT / "configs" / "simulate" / f"scale-{model}.yaml")
    assert sum(p for _, p in layer_params(base.model)) == params
    sc = scaled(base, 1024, 200, 1.0, H=128)
    assert [c.count for c in sc.clusters] == [230, 227, 227, 227, 113]  # 2:2:2:2:1 rounded down, rest to A
    assert sc.followers.count == base.model.num_layers + 2 and sc.H == 128
    assert sc.data.num_chunks == 8 * 1024 and sc.horizon_s == 86400.0
    # Two pushes held: 18 + 2 x 4 + 4 + 8 = 38 bytes per parameter, ~10x the FP32 shard.
    assert memory_bytes(base.followers.memory, 1, 2) == 38


def test_a_small_projection_fills_the_table(tmp_path):
    base = load_sim_scenario(ROOT / "configs" / "simulate" / "scale-14b.yaml")
    sc = scaled(base, 18, 8, 0.5)
    row = _row("14b", sc, simulate(sc))
    assert row["clusters"] == 18 and row["followers"] == 8 and row["outer_steps"] > 0
    assert row["msg_peak"] >= row["msg_peak_no_hb"] > 0 and 0 <= row["rejected_frac"] < 0.1
    assert row["memory_bytes_per_param"] >= 38 - 1e-9
    assert "| 14b | 18 | 8 |" in table([row])
    # The leader-load plot: one series per (model, followers), a PNG on disk.
    other = dict(row, clusters=36, msg_avg=2 * row["msg_avg"], msg_peak=2 * row["msg_peak"])
    labels = plot_load([other, row, dict(row, followers=16)], tmp_path / "leader_load.png")
    assert labels == ["14b, 8 followers", "14b, 16 followers"]
    assert (tmp_path / "leader_load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
