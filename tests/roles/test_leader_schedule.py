"""The leader's §10 schedules across clusters: follower use is remembered across the clusters
of a round (they push at the same time) and across rounds, without recomputing anyone's
schedule (hand-checked; the schedule's own properties are in tests/algo/test_schedule.py)."""

from __future__ import annotations

import pytest

from dips.roles.leader import FollowerEntry, Leader, LeaderConfig

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def leader():
    lead = Leader(LeaderConfig(followers=2), connect=lambda e: None)  # not started: no threads
    lead.register_follower(FollowerEntry(0, "tcp://x:1", "", ["l0", "l1"], [4, 4]))
    lead.register_follower(FollowerEntry(1, "tcp://x:2", "", ["l2", "l3"], [4, 4]))
    return lead


def test_concurrent_clusters_start_on_different_followers(leader):
    stages = [["l0", "l1", "l2", "l3"]]  # one stage worker, two layers on each follower
    a = leader._schedule(7, stages)
    # First cluster, no history: f0 (tie -> lowest), then f1 (never used), f0, f1.
    assert a == [[(0, "l0", 0)], [(0, "l2", 1)], [(0, "l1", 0)], [(0, "l3", 1)]]
    b = leader._schedule(7, stages)
    # Same round: at each step the other cluster's follower counts as just used.
    assert b == [[(0, "l2", 1)], [(0, "l0", 0)], [(0, "l3", 1)], [(0, "l1", 0)]]
    assert all(sa[0][2] != sb[0][2] for sa, sb in zip(a, b))


def test_next_round_starts_on_the_least_recently_used_follower(leader):
    stages = [["l0", "l1", "l2", "l3"]]
    leader._schedule(1, stages)  # round 1 ends on f1 (step 3) after f0 (step 2)
    assert leader._schedule(2, stages)[0] == [(0, "l0", 0)]
    # Round 3, two stages: step 0 w0 -> f1 (l2), w1 -> f0 (l0); step 1 w1 -> f0 (l1, tie ->
    # lowest); step 2 w1 -> f1 (l3). So round 4 starts on f0 again (used at step 1 < 2).
    assert leader._schedule(3, [["l2"], ["l0", "l1", "l3"]]) == [
        [(0, "l2", 1), (1, "l0", 0)], [(1, "l1", 0)], [(1, "l3", 1)]]
    assert leader._schedule(4, stages)[0] == [(0, "l0", 0)]


def test_layers_go_in_model_order_within_a_follower(leader):
    # Names that sort differently from model order ("l10" < "l2"): the stage order wins.
    lead = Leader(LeaderConfig(followers=1), connect=lambda e: None)
    lead.register_follower(FollowerEntry(0, "tcp://x:1", "", ["l2", "l10"], [4, 4]))
    assert lead._schedule(0, [["l2", "l10"]]) == [[(0, "l2", 0)], [(0, "l10", 0)]]
