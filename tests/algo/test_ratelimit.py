"""The token bucket of :mod:`dips.algo.ratelimit` (issue 13, review 25 M1), hand-computed."""

from __future__ import annotations

import pytest

from dips.algo.ratelimit import Bucket, take


def test_a_new_bucket_allows_a_burst_then_refuses():
    bucket, allowed = None, []
    for _ in range(4):
        bucket, ok = take(bucket, now=10.0, rate=2.0, burst=3)
        allowed.append(ok)
    assert allowed == [True, True, True, False]
    assert bucket == Bucket(0.0, 10.0)


def test_tokens_come_back_at_the_rate_up_to_the_burst():
    bucket = Bucket(0.0, 10.0)
    bucket, ok = take(bucket, now=10.25, rate=2.0, burst=3)  # 0.5 token: refused
    assert (ok, bucket) == (False, Bucket(0.5, 10.25))
    bucket, ok = take(bucket, now=10.5, rate=2.0, burst=3)  # 1.0 token: taken
    assert (ok, bucket) == (True, Bucket(0.0, 10.5))
    bucket, ok = take(bucket, now=1000.0, rate=2.0, burst=3)  # full again: 3 - 1
    assert (ok, bucket) == (True, Bucket(2.0, 1000.0))


def test_a_clock_that_goes_back_adds_nothing():
    bucket, ok = take(Bucket(0.25, 10.0), now=5.0, rate=2.0, burst=3)
    assert (ok, bucket) == (False, Bucket(0.25, 10.0))


def test_the_sustained_rate_is_the_configured_one():
    bucket, granted = None, 0
    for i in range(1000):  # 100 s of calls every 0.1 s against 2 calls/s, burst 3
        bucket, ok = take(bucket, now=i * 0.1, rate=2.0, burst=3)
        granted += ok
    assert granted == 3 + 199  # the burst, then one per 0.5 s of the 99.9 s that followed


@pytest.mark.parametrize("rate,burst,field", [(0, 3, "rate"), (float("inf"), 3, "rate"),
                                              (1, 0.5, "burst"), (1, float("nan"), "burst")])
def test_bad_limits_name_the_field(rate, burst, field):
    with pytest.raises(ValueError, match=field):
        take(None, 0.0, rate, burst)
