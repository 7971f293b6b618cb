"""Bandwidth schedules of real-time Di-PS (clusters[].link_schedule, dips.emu.link_schedule):
the token bucket of a cluster and the tc tbf of its veth change rate when a change is due.

The kernel test needs root, `ip`, `tc` and network namespaces (skipped otherwise, with the
reason); it creates its own namespaces (198.18.0.0/15 only) and checks none survive.
"""

from __future__ import annotations

import time

import pytest

from dips.config import ClusterSpec
from dips.emu import netns
from dips.emu.link_schedule import LinkSchedule, ScheduledBucket
from dips.emu.netprobe import measure_tcp_bps

pytestmark = pytest.mark.timeout(90)

_CAP = netns.probe()
needs_netns = pytest.mark.skipif(_CAP.shaping != "tc-tbf",
                                 reason=f"kernel shaping unavailable here: {_CAP.reason}")


class _FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_scheduled_bucket_switches_rate_when_due():
    ft = _FakeTime()
    spec = ClusterSpec(id="a", link_bps=8e6, link_schedule=[(2.0, 2e6)])  # 1 MB/s, then 250 kB/s
    b = ScheduledBucket(spec, clock=ft.clock, sleep=ft.sleep, monotonic=ft.clock)
    assert b.rate_bps() == 8e6  # before the training start: the rate at time 0
    b.start(ft.now)

    def rate_over(nbytes: int) -> float:
        t0 = ft.now
        for _ in range(nbytes // 10_000):
            b.consume(10_000)
        return nbytes * 8 / (ft.now - t0)

    b.consume(int(b.bucket.burst_bytes))  # empty the initial burst
    assert rate_over(1_000_000) == pytest.approx(8e6, rel=0.02)  # 1 s at 1 MB/s, t = 1 s
    ft.now += 1.0  # t = 2 s: the change is due; a fresh bucket of the new rate and burst
    b.consume(0)
    assert b.rate_bps() == 2e6 and b.bucket.rate_bytes_per_s == 2e6 / 8
    assert b.bucket.burst_bytes == 32768  # 5 ms at 250 kB/s is less than the 32 KiB floor
    b.consume(32768)
    assert rate_over(250_000) == pytest.approx(2e6, rel=0.02)
    with pytest.raises(ValueError, match="link_bps is None"):
        ScheduledBucket(ClusterSpec(id="x"))


def test_scheduled_bucket_real_clock_within_20_percent():
    """The same change with the real clock: the measured send rate follows within ±20%."""
    spec = ClusterSpec(id="a", link_bps=16e6, link_schedule=[(0.6, 4e6)])
    b = ScheduledBucket(spec)
    b.start(time.time())

    def measure(until_s: float) -> float:
        sent, t0 = 0, time.monotonic()
        while time.time() - b.t0 < until_s:
            b.consume(8192)
            sent += 8192
        return sent * 8 / (time.monotonic() - t0)

    b.consume(int(b.bucket.burst_bytes))
    before = measure(0.5)
    while time.time() - b.t0 < 0.6:
        time.sleep(0.01)
    b.consume(0)
    b.consume(int(b.bucket.burst_bytes))
    after = measure(1.2)
    assert 0.8 * 16e6 <= before <= 1.2 * 16e6, before
    assert 0.8 * 4e6 <= after <= 1.2 * 4e6, after


def test_link_schedule_fires_in_order_and_records_events():
    calls, events = [], []

    class _Net:
        def set_rate(self, cid, bps):
            calls.append((cid, bps))

    clusters = [ClusterSpec(id="a", link_bps=1e6, link_schedule=[(3.0, 5e5), (1.0, 2e6)]),
                ClusterSpec(id="b", link_bps=1e6, link_schedule=[(2.0, 1e5)]), ClusterSpec(id="c")]
    links = LinkSchedule(clusters, _Net(), lambda kind, proc, **kw: events.append((kind, proc, kw)))
    assert links.tick(0.5) == []
    assert links.tick(2.5) == [("a", 2e6), ("b", 1e5)]
    assert links.tick(10.0) == [("a", 5e5)] and links.tick(11.0) == []
    assert calls == [("a", 2e6), ("b", 1e5), ("a", 5e5)]
    assert [(p, kw["link_bps"], kw["at_s"], kw["how"]) for _, p, kw in events] == [
        ("cluster-a", 2e6, 1.0, "tc-tbf"), ("cluster-b", 1e5, 2.0, "tc-tbf"), ("cluster-a", 5e5, 3.0, "tc-tbf")]
    # Without a network (loopback) nothing is set; the change is only recorded.
    events.clear()
    assert LinkSchedule(clusters, None, lambda k, p, **kw: events.append(kw)).tick(1.0) == [("a", 2e6)]
    assert events[0]["how"] == "token-bucket"


@needs_netns
def test_link_schedule_changes_a_live_tbf_rate():
    spec = ClusterSpec(id="a", link_bps=80e6, link_schedule=[(1.0, 20e6)])
    with netns.ShapedNetwork(["a", "b"], {"a": spec.link_bps, "b": None}) as net:
        prefix = net.prefix
        links = LinkSchedule([spec], net)
        assert links.tick(0.5) == []
        before = measure_tcp_bps(net, "a", None, 1.5)  # a's upload to the hub
        assert links.tick(1.0) == [("a", 20e6)]
        assert "rate 20Mbit" in net.qdiscs("a")
        up = measure_tcp_bps(net, "a", None, 1.5)
        down = measure_tcp_bps(net, "b", "a", 1.5)  # a's download, across the hub's bridge
    assert 0.8 * 80e6 <= before <= 1.2 * 80e6, f"80 Mbit link delivered {before / 1e6:.1f} Mbit/s"
    assert 0.8 * 20e6 <= up <= 1.2 * 20e6, f"20 Mbit link (upload) delivered {up / 1e6:.1f} Mbit/s"
    assert 0.8 * 20e6 <= down <= 1.2 * 20e6, f"20 Mbit link (download) delivered {down / 1e6:.1f} Mbit/s"
    assert netns.list_namespaces(prefix) == []
