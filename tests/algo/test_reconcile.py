"""Reconciliation target after a follower or leader failure: all followers or none."""

import pytest

from dips.algo.reconcile import FollowerReport as R
from dips.algo.reconcile import ReconcileError, reconcile_target


def test_consistent_followers_keep_their_version():
    assert reconcile_target([R(0, 5, -1, (4, 5)), R(1, 5, -1, (5,))]) == 5


def test_roll_forward_when_every_follower_prepared_or_committed():
    # The leader died between commits: follower 0 committed 6, follower 1 only prepared it.
    assert reconcile_target([R(0, 6, -1, (5,)), R(1, 5, 6, (4, 5))]) == 6


def test_roll_back_when_a_follower_lost_the_prepared_step():
    # Follower 1 crashed after follower 0 committed 6 and restarted from its checkpoint 5.
    assert reconcile_target([R(0, 6, -1, (4, 5)), R(1, 5, -1, (4, 5))]) == 5


def test_roll_back_to_older_checkpoint_when_newest_is_missing():
    assert reconcile_target([R(0, 7, -1, (5, 6)), R(1, 5, -1, (4, 5))]) == 5


def test_prepared_only_everywhere_commits():
    assert reconcile_target([R(0, 3, 4), R(1, 3, 4)]) == 4


def test_errors_name_the_problem():
    with pytest.raises(ReconcileError, match="follower 1: version 2"):
        reconcile_target([R(0, 9, -1, (8, 9)), R(1, 2, -1, (1, 2))])
    with pytest.raises(ValueError, match="no follower"):
        reconcile_target([])
    with pytest.raises(ValueError, match="'version' = -1"):
        reconcile_target([R(0, -1)])


def test_cap_blocks_rolling_forward_an_unrecorded_decision():
    # Every follower prepared 4 but the leader died before recording the decision.
    assert reconcile_target([R(0, 3, 4), R(1, 3, 4)], cap=3) == 3
    assert reconcile_target([R(0, 6, -1, (5,)), R(1, 5, 6, (5,))], cap=6) == 6
