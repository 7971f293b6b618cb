"""The leader's messages in a simulation (dips.sim.messages): one per RPC it receives, each
when it arrives; heartbeats at the times the protocol gives them (review of issue 16)."""

from __future__ import annotations

import numpy as np
import pytest

from dips.sim import simulate
from dips.sim.engine import Simulation
from dips.sim.messages import Beats
from tests.sim.helpers import small

pytestmark = pytest.mark.timeout(60)


def test_beats_fall_where_each_life_puts_them():
    b = Beats(10.0)
    b.start("c", "Heartbeat", 12.5)       # joined at 2.5: beats at 12.5, 22.5, ...
    b.start("c", "Heartbeat", 99.0)       # one thread per process: no second start
    b.start("f", "RegisterFollower", 0.0)  # registers at start: 0, 10, 20, ...
    b.stop("f", 25.0)                     # killed at 25: no beat at 30
    b.start("f", "RegisterFollower", 31.0)  # resumed: registers at once
    b.leader(40.0, down=True)             # beats in [40, 52) are lost
    b.leader(52.0, down=False)
    b.start("g", "RegisterFollower", 53.5, once_s=53.0)  # started at 53: at once, then 53.5
    counts, hist = b.histogram(60.0, 61)
    got = {int(t) for t in np.nonzero(hist)[0]}
    assert got == {0, 10, 20, 31, 12, 22, 32, 52, 53}  # c at 42 and f at 41, 51 lost
    assert counts == {"Heartbeat": 4, "RegisterFollower": 6}
    assert hist.sum() == 10 and hist.max() == 2  # g's two in second 53
    with pytest.raises(ValueError, match="period_s = 0"):
        Beats(0)


def test_every_follower_call_is_a_message_and_sequential_applies_arrive_in_turn():
    """Sequential apply (dips' leader calls Apply in turn): each follower's Apply reply
    reaches the leader when its outer step is done, not all at the update's start."""
    seq = small(followers={"update_s_per_param": 4.0e-6, "apply": "sequential"},
                horizon_s=400)
    sim = Simulation(seq).run()
    steps, M = sim.version, seq.followers.count
    assert steps > 0
    for rpc in ("Apply", "Commit", "Aggregate"):
        assert sim.msgs[rpc] == M * steps, rpc
    assert sim.msgs["Score"] == M * sum(sim.round_sizes.values())
    # the first update: Score and Aggregate at its start, one Apply per follower after another
    first = min(b for b in sim.follower_bins if b > 0)
    assert sim.follower_bins[first] == 2 * M
    per_param = seq.followers.update_s_per_param
    busy = [ld.params * per_param for ld in sim.loads]
    assert min(busy) > 1.0  # so the replies fall in different seconds
    doc = simulate(seq)
    assert max(n for b, n in sim.follower_bins.items() if b > 0) == 2 * M  # (was 3 × M)
    assert doc["leader"]["by_kind"]["GetState"] == M  # the leader's first reconciliation


def test_members_started_together_beat_at_their_own_offsets():
    """Issue 16: each heartbeat loop's first beat at a drawn offset within the interval
    (dips.algo.ratelimit.first_beat_delay), seeded from the scenario's seed. Before, the 3
    followers registering together and a, a and b joining at 0 beat in one second for ever
    (7 heartbeats in the busiest second)."""
    sc = small(horizon_s=300, leader={"membership": {"heartbeat_interval_s": 5.0}})
    sim = Simulation(sc).run()
    lives = {k: v for k, v in sim.beats.open.items()}
    joins = {"a1": 0.0, "a2": 0.0, "b": 0.0, "c": 30.0}
    offsets = {k: first - (0.0 if once is not None else joins[k]) for k, (_, first, once)
               in lives.items()}
    assert all(0.0 <= o < 5.0 for o in offsets.values())
    assert len({round(o, 6) for o in offsets.values()}) == len(offsets)  # all different
    doc = simulate(sc)
    lead = doc["leader"]
    assert lead["by_kind"]["RegisterFollower"] == 3 * (1 + 60)  # at start, then 60 intervals
    # the 3 registrations at the start, and beats whose offset fell into second 0 (old: 7)
    assert lead["msg_rate_peak_heartbeats"] < 3 + 4
    again = simulate(sc)["leader"]
    assert again == lead  # the offsets come from the scenario's seed
    other = Simulation(small(horizon_s=300, seed=4,
                             leader={"membership": {"heartbeat_interval_s": 5.0}})).run()
    assert {k: v[1] for k, v in other.beats.open.items()} != {k: v[1] for k, v in lives.items()}
