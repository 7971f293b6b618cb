"""The virtual clock (dips.emu.vclock): transfers cost exactly bytes / rate, hand-computed."""

from __future__ import annotations

import pytest

from dips.emu.vclock import EventQueue, ideal_tokens, ring_allreduce_s, step_duration, transfer_s
from dips.spec import ClusterConfig, LinkConfig, RateChange, Transient

pytestmark = pytest.mark.timeout(30)


def test_transfer_is_bytes_over_bandwidth() -> None:
    link = ClusterConfig(id="a", link=LinkConfig(bps=1e10))
    # 1.25e9 bytes = 1e10 bits at 1e10 bit/s: exactly 1 s, from any start time.
    assert transfer_s(link, 0.0, 1.25e9) == 1.0
    assert transfer_s(link, 37.0, 1.25e9) == 1.0
    # 2.47e9 bytes (a 1B model in BF16) at 10 Gbit: 1.976 s; plus 0.05 s latency.
    assert transfer_s(link, 0.0, 2.47e9) == pytest.approx(1.976, abs=1e-12)
    assert transfer_s(link, 0.0, 2.47e9, latency_s=0.05) == pytest.approx(2.026, abs=1e-12)
    # Capped by a 1 Gbit peer: 10x longer.
    assert transfer_s(link, 0.0, 1.25e9, cap_bps=1e9) == pytest.approx(10.0, abs=1e-12)
    assert transfer_s(link, 0.0, 0.0) == 0.0


def test_transfer_across_a_bandwidth_drop() -> None:
    link = ClusterConfig(id="a", link=LinkConfig(bps=1e10, schedule=[RateChange(at_s=0.5, bps=1e9)]))
    # First 0.5 s at 10 Gbit moves 0.625e9 bytes; the other 0.625e9 bytes at 1 Gbit take 5 s.
    assert transfer_s(link, 0.0, 1.25e9) == pytest.approx(5.5, abs=1e-12)
    # Entirely before the drop, entirely after it.
    assert transfer_s(link, 0.0, 0.5e9) == pytest.approx(0.4, abs=1e-12)
    assert transfer_s(link, 0.5, 1.25e9) == pytest.approx(10.0, abs=1e-12)
    assert link.link.rate_at(0.49) == 1e10 and link.link.rate_at(0.5) == 1e9


def test_transfer_refuses_bad_input() -> None:
    link = ClusterConfig(id="a", link=LinkConfig(bps=1e10))
    with pytest.raises(ValueError, match="nbytes"):
        transfer_s(link, 0.0, -1.0)
    with pytest.raises(ValueError, match="start_s"):
        transfer_s(link, float("nan"), 1.0)
    with pytest.raises(ValueError, match="no link"):
        transfer_s(ClusterConfig(id="b"), 0.0, 1.0)


def test_ring_allreduce_uses_the_slowest_link() -> None:
    links = [ClusterConfig(id=f"c{i}", link=LinkConfig(bps=g)) for i, g in
             enumerate((1e10, 1e10, 1e10, 5e9))]
    # Each link carries 2(N-1)/N = 1.5 x 1.25e9 bytes; at 5 Gbit: 1.875e9 * 8 / 5e9 = 3 s.
    assert ring_allreduce_s(links, 0.0, 1.25e9) == pytest.approx(3.0, abs=1e-12)
    assert ring_allreduce_s(links[:1], 0.0, 1.25e9) == 0.0


def test_step_duration_with_slowdown_and_transient() -> None:
    c = ClusterConfig(id="a", slowdown=1.5, transient=[Transient(start_s=10, end_s=20, factor=2)])
    assert step_duration(c, 0.0, 2.0) == 3.0
    assert step_duration(c, 10.0, 2.0) == 6.0
    assert step_duration(c, 20.0, 2.0) == 3.0
    # Ideal: 2 s steps at slowdown 1 finish at 2,4,...,10 -> 5 steps by t=10; the 1.5x
    # cluster's 3 s steps finish at 3,6,9 -> 3 steps (the transient starts at 10).
    fast = ClusterConfig(id="b")
    assert ideal_tokens([fast, c], 2.0, 100, 10.0) == (5 + 3) * 100


def test_event_queue_orders_by_time_priority_then_insertion() -> None:
    q = EventQueue()
    q.push(2.0, "late")
    q.push(1.0, "b", priority=1)
    q.push(1.0, "a1")
    q.push(1.0, "a2")
    assert [q.pop()[1] for _ in range(4)] == ["a1", "a2", "b", "late"]
    assert q.now == 2.0
    with pytest.raises(ValueError, match="before now"):
        q.push(1.5, "past")
