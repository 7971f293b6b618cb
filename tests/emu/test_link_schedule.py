"""Bandwidth schedules of real-time Di-PS (clusters[].link.schedule, dips.emu.link_schedule):
the token bucket of a cluster and the tc tbf of its veth change rate when a change is due.

The kernel test needs root, `ip`, `tc` and network namespaces (skipped otherwise, with the
reason); it creates its own namespaces (198.18.0.0/15 only) and checks none survive.
"""

from __future__ import annotations

import time

import pytest

from dips.emu import netns
from dips.emu.link_schedule import LinkSchedule, ScheduledBucket
from tests.emu.shaping_bound import assert_at_most, delivered
from dips.spec import ClusterConfig


def _cluster(id: str, link_bps: float | None = None,
                link_schedule: list[tuple[float, float]] = ()) -> ClusterConfig:
    """A cluster with a link of ``link_bps`` bits/s and ``(at_s, bps)`` changes."""
    link = None if link_bps is None else {"bps": link_bps, "schedule": [
        {"at_s": at, "bps": bps} for at, bps in link_schedule]}
    return ClusterConfig.model_validate({"id": id, "link": link})

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
    spec = _cluster(id="a", link_bps=8e6, link_schedule=[(2.0, 2e6)])  # 1 MB/s, then 250 kB/s
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
    with pytest.raises(ValueError, match="link is None"):
        ScheduledBucket(_cluster(id="x"))


def test_scheduled_bucket_real_clock_keeps_to_the_rate():
    """The same change with the real clock. A busy machine can only slow the sender down, so
    the checks are the bucket's two bounds, which hold under any load: it never lets more than
    one burst beyond the rate through, and never asks to wait longer than the bytes need at
    that rate (the exact rates are checked with the fake clock above)."""
    spec = _cluster(id="a", link_bps=16e6, link_schedule=[(0.6, 4e6)])
    b = ScheduledBucket(spec)
    b.start(time.time())

    def send(until_s: float) -> tuple[int, float, float, float]:
        """Send 8 KiB messages until ``until_s`` after the start: (bytes, seconds, seconds
        waited, burst of the bucket in force when it began)."""
        burst, sent, waited, t0 = b.bucket.burst_bytes, 0, 0.0, time.monotonic()
        while time.time() - b.t0 < until_s:
            waited += b.consume(8192)
            sent += 8192
        return sent, time.monotonic() - t0, waited, burst

    sent, took, waited, burst = send(0.5)
    # (If this process was held up past 0.6 s, the change came inside: a fresh, full bucket.)
    bursts = 1 if b.rate_bps() == 16e6 else 2
    assert sent <= bursts * burst + 16e6 / 8 * took + 8192, (sent, took)
    assert waited <= sent / (4e6 / 8) and took >= waited - 1e-3
    while time.time() - b.t0 < 0.6:  # the change is due at 0.6 s
        time.sleep(0.01)
    b.consume(0)
    assert b.rate_bps() == 4e6 and b.bucket.rate_bytes_per_s == 4e6 / 8
    sent, took, waited, burst = send(1.2)
    assert sent <= burst + 4e6 / 8 * took + 8192, (sent, took)
    assert waited <= sent / (4e6 / 8) + 1e-6 and took >= waited - 1e-3


def test_link_schedule_fires_in_order_and_records_events():
    calls, events = [], []

    class _Net:
        def set_rate(self, cid, bps):
            calls.append((cid, bps))

    clusters = [_cluster(id="a", link_bps=1e6, link_schedule=[(3.0, 5e5), (1.0, 2e6)]),
                _cluster(id="b", link_bps=1e6, link_schedule=[(2.0, 1e5)]), _cluster(id="c")]
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
    spec = _cluster(id="a", link_bps=80e6, link_schedule=[(1.0, 20e6)])
    with netns.ShapedNetwork(["a", "b"], {"a": spec.link.bps, "b": None}) as net:
        prefix = net.prefix
        links = LinkSchedule([spec], net)
        assert links.tick(0.5) == []
        assert "rate 80Mbit" in net.qdiscs("a")
        before = delivered(net, "a", None, 1.5)  # a's upload to the hub
        assert links.tick(1.0) == [("a", 20e6)]
        assert "rate 20Mbit" in net.qdiscs("a")
        up = delivered(net, "a", None, 1.5)
        down = delivered(net, "b", "a", 1.5)  # a's download, across the hub's bridge
    # Measured so that load can only understate it (tests/emu/shaping_bound.py): the link
    # never delivers more than its rate, before and after the change.
    assert_at_most(80e6, netns.tbf_burst(80e6), before, "80 Mbit link")
    assert_at_most(20e6, netns.tbf_burst(20e6), up, "20 Mbit link (upload)")
    assert_at_most(20e6, netns.tbf_burst(20e6), down, "20 Mbit link (download)")
    assert netns.list_namespaces(prefix) == []
