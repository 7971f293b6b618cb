"""timeline.png stays readable at any size (review of issue 16): one row per cluster up to
ROWS_MAX rows, groups of clusters (their share in each state over time) above."""

from __future__ import annotations

import numpy as np
import pytest

from dips.sim import plots
from dips.sim.engine import Simulation
from tests.sim.helpers import small

pytestmark = pytest.mark.timeout(60)


def test_occupancy_is_the_exact_time_share_per_bin():
    # bins of 10 s over 40 s: [5, 25) covers half of bin 0, all of bin 1, half of bin 2;
    # [12, 14) a fifth of bin 1; [30, 50) clipped to the window: all of bin 3.
    got = plots.occupancy([(5.0, 25.0), (12.0, 14.0), (30.0, 50.0), (7.0, 7.0)], 40.0, 4)
    assert np.allclose(got, [0.5, 1.2, 0.5, 1.0])
    assert not plots.occupancy([], 40.0, 4).any()


def _wide(types: int, per_type: int):
    clusters = [{"id": f"t{k}", "count": per_type, "stages": 1, "step_s": 2.0 + k,
                 "windows_per_step": 4, "uplink": {"bps": 1.0e8}} for k in range(types)]
    return Simulation(small(clusters=clusters, horizon_s=120, timeline_s=120)).run()


def test_many_clusters_are_drawn_as_groups_slowest_first(tmp_path):
    sim = _wide(3, 24)  # 72 clusters + 3 followers: above ROWS_MAX
    assert len(sim.members) + len(sim.loads) > plots.ROWS_MAX
    panels = plots.groups(sim)
    assert [label.split(":")[0] for label, _ in panels] == ["t2", "t1", "t0"]
    assert [len(ms) for _, ms in panels] == [24, 24, 24]
    assert plots.timeline(sim, tmp_path / "t.png") == "t.png"
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_more_types_than_panels_become_bands_of_clusters_by_speed():
    sim = _wide(plots.GROUPS_MAX + 2, 7)  # 70 clusters of 10 types
    panels = plots.groups(sim)
    assert len(panels) == plots.GROUPS_MAX
    assert sum(len(ms) for _, ms in panels) == 70
    steps = [m.cfg.step_s for _, ms in panels for m in ms]
    assert steps == sorted(steps, reverse=True)
