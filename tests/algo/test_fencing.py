"""One leader at a time: the lease rules of dips.algo.fencing against hand-worked cases."""

from __future__ import annotations

import pytest

from dips.algo.fencing import LeaderLease, give_up, lease_seconds, offer
from dips.algo.refusal import Refusal


def test_a_fresh_follower_takes_the_first_term():
    out = offer(LeaderLease(), 1, now=10.0, lease_s=3.0)
    assert out.refusal is None and out.adopted and out.lease == LeaderLease(1, 10.0)


def test_the_same_term_renews_and_a_lower_one_is_stale():
    lease = LeaderLease(4, 10.0)
    renewed = offer(lease, 4, now=12.5, lease_s=3.0)
    assert renewed.refusal is None and not renewed.adopted and renewed.lease == LeaderLease(4, 12.5)
    stale = offer(lease, 3, now=100.0, lease_s=3.0)  # even long after: a lower term never wins
    assert stale.refusal is Refusal.STALE_TERM and stale.lease == lease


def test_a_higher_term_waits_for_the_lease_to_expire():
    lease = LeaderLease(4, 10.0)
    held = offer(lease, 5, now=11.0, lease_s=3.0)
    assert held.refusal is Refusal.LEASE_HELD and held.left_s == pytest.approx(2.0)
    assert held.lease == lease  # nothing changed
    taken = offer(lease, 5, now=13.0, lease_s=3.0)  # 3 s without a word: expired
    assert taken.refusal is None and taken.adopted and taken.lease == LeaderLease(5, 13.0)


def test_a_restarted_follower_holds_no_lease_but_keeps_its_term():
    lease = LeaderLease(7, None)
    assert offer(lease, 6, now=0.0, lease_s=3.0).refusal is Refusal.STALE_TERM
    assert offer(lease, 8, now=0.0, lease_s=3.0).adopted


def test_give_up_after_two_lease_periods_and_the_lease_length():
    assert not give_up(held_since=10.0, now=16.0, lease_s=3.0)
    assert give_up(held_since=10.0, now=16.1, lease_s=3.0)
    assert lease_seconds(1.0, 3) == 3.0


def test_bad_terms_are_refused():
    with pytest.raises(ValueError, match="term = 0"):
        offer(LeaderLease(), 0, now=0.0, lease_s=3.0)
    with pytest.raises(ValueError, match="lease_s"):
        offer(LeaderLease(), 1, now=0.0, lease_s=0.0)
