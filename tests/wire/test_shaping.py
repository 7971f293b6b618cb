"""The application-level token bucket (dips.wire.shaping): rate, bursts, threads, bad input.

A fake clock whose sleep advances time makes the rate checks exact and never flaky.
"""

from __future__ import annotations

import math
import threading

import pytest

from dips.wire.shaping import TokenBucket

pytestmark = pytest.mark.timeout(30)


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def _bucket(rate: float, burst: float) -> tuple[TokenBucket, FakeClock]:
    clock = FakeClock()
    return TokenBucket(rate, burst, clock=clock, sleep=clock.sleep), clock


@pytest.mark.parametrize("rate,chunk", [(1e6, 65536), (12.5e6, 1 << 20), (5e3, 1500)])
def test_delivers_its_rate_within_20_percent(rate, chunk):
    burst = 4 * chunk
    bucket, clock = _bucket(rate, burst)
    start, total = clock.t, 0
    for _ in range(200):
        bucket.consume(chunk)
        total += chunk
    elapsed = clock.t - start
    assert 0.8 * rate <= total / elapsed <= 1.2 * rate
    # Never more than a full bucket ahead of the rate: total <= burst + rate * elapsed.
    assert total <= burst + rate * elapsed + 1e-6
    assert bucket.consumed == total


def test_burst_passes_without_waiting_then_the_rate_holds():
    bucket, clock = _bucket(1000.0, 5000.0)
    assert bucket.consume(5000) == 0.0 and clock.slept == []
    assert bucket.consume(1000) == pytest.approx(1.0)
    clock.t += 10.0  # idle time refills the bucket, but never beyond its capacity
    assert bucket.consume(5000) == 0.0
    assert bucket.consume(500) == pytest.approx(0.5)


def test_a_message_larger_than_the_bucket_borrows():
    bucket, clock = _bucket(1e6, 64 * 1024)
    waited = bucket.consume(10_000_000)
    assert waited == pytest.approx((10_000_000 - 64 * 1024) / 1e6)


def test_set_rate_changes_the_pace():
    bucket, clock = _bucket(1e6, 1000.0)
    bucket.consume(1000)
    assert bucket.consume(1_000_000) == pytest.approx(1.0)
    bucket.set_rate(0.5e6)
    assert bucket.consume(1_000_000) == pytest.approx(2.0)
    assert bucket.rate_bytes_per_s == 0.5e6


def test_concurrent_reservations_are_serialized():
    """8 threads reserve 1000 B each, 50 times, at a frozen clock: no reservation is lost, so
    the waits are exactly the arithmetic sequence of a single queue."""
    clock = FakeClock()
    bucket = TokenBucket(1000.0, 1000.0, clock=clock, sleep=clock.sleep)
    waits: list[float] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(50):
            w = bucket.reserve(1000)
            with lock:
                waits.append(w)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(waits) == pytest.approx([float(k) for k in range(400)])
    assert bucket.consumed == 400_000


@pytest.mark.parametrize("field,args", [
    ("rate_bytes_per_s", (0, 10)), ("rate_bytes_per_s", (-1, 10)),
    ("rate_bytes_per_s", (math.nan, 10)), ("rate_bytes_per_s", (True, 10)),
    ("rate_bytes_per_s", (math.inf, 10)), ("burst_bytes", (10, 0)), ("burst_bytes", (10, "5")),
])
def test_bad_arguments_are_refused_by_name(field, args):
    with pytest.raises(ValueError, match=field):
        TokenBucket(*args)


def test_bad_consume_and_rate_change_change_nothing():
    bucket, clock = _bucket(1000.0, 1000.0)
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match="nbytes"):
            bucket.consume(bad)
    assert bucket.consumed == 0
    with pytest.raises(ValueError, match="rate_bytes_per_s"):
        bucket.set_rate(0)
    assert bucket.rate_bytes_per_s == 1000.0
    assert bucket.consume(1000) == 0.0  # the bucket is still full
