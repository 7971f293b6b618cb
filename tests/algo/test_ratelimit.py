"""The token bucket of :mod:`dips.algo.ratelimit` (issue 13, review 25 M1; heartbeats: review
30), hand-computed."""

from __future__ import annotations

import random

import pytest

from dips.algo.ratelimit import (
    HEARTBEAT_BURST,
    HEARTBEAT_RATE_FACTOR,
    Bucket,
    first_beat_delay,
    heartbeat_limit,
    take,
)


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


# ----- heartbeats (issue 13, review 30: not rate-limited, 1,014/s of one member served) -----
def _refused(times, interval_s):
    """Indices (in time order) of the heartbeats at ``times`` that the bucket of
    :func:`heartbeat_limit` refuses."""
    rate, burst = heartbeat_limit(interval_s)
    bucket, out = None, []
    for i, t in enumerate(sorted(times)):
        bucket, ok = take(bucket, t, rate, burst)
        if not ok:
            out.append(i)
    return out


def test_the_heartbeat_limit_is_a_multiple_of_the_interval():
    assert (HEARTBEAT_RATE_FACTOR, HEARTBEAT_BURST) == (4.0, 8)
    assert heartbeat_limit(0.5) == (8.0, 8.0) and heartbeat_limit(2) == (2.0, 8.0)
    for bad in (0, -1.0, float("inf"), float("nan"), "1"):
        with pytest.raises(ValueError, match="heartbeat_interval_s"):
            heartbeat_limit(bad)


@pytest.mark.parametrize("interval_s", [1.0, 0.25, 0.3])
def test_honest_heartbeats_on_their_period_are_never_refused(interval_s):
    assert _refused([k * interval_s for k in range(10_000)], interval_s) == []


def test_honest_heartbeats_with_seven_intervals_of_jitter_are_never_refused():
    # Each beat's time at the leader anywhere within ±3.5 intervals of its schedule (2J = 7 I).
    rng = random.Random(13)
    assert _refused([k + rng.uniform(-3.5, 3.5) for k in range(10_000)], 1.0) == []
    # The worst case, over and over: 8 beats that arrive at once (7 delayed until the 8th's
    # time: a leader that stalled while they waited), then on the schedule again.
    piled = [8.0 * (k // 8) + 7 for k in range(8_000)]  # 8 at 7, 8 at 15, ...
    assert _refused(piled, 1.0) == []
    steady_then_pile = [float(k) for k in range(100)] + [107.0] * 8 + [108.0, 109.0]
    assert _refused(steady_then_pile, 1.0) == []


def test_a_ninth_beat_at_once_and_a_flood_are_refused():
    assert _refused([5.0] * 9, 1.0) == [8]  # the bound is the burst: one more is refused
    # A flood every 1/64 s for 64 s: the burst, then 4 per second.
    times = [i / 64 for i in range(64 * 64)]
    assert len(times) - len(_refused(times, 1.0)) == 8 + 255  # 4 × 4095/64 = 255.9 tokens


# ----- the first beat at a random offset (issue 16) -----
def test_the_first_beat_comes_at_the_drawn_offset_but_never_within_an_interval_of_the_last():
    assert first_beat_delay(27.0, 0.0) == 0.0 and first_beat_delay(27.0, 0.5) == 13.5
    assert first_beat_delay(2.0, 0.25, since_last_s=0.5) == 1.5  # a thread started again
    assert first_beat_delay(2.0, 0.25, since_last_s=10.0) == 0.5
    for kw in ({"interval_s": 0}, {"interval_s": float("inf")}, {"u": 1.0}, {"u": -0.1},
               {"u": float("nan")}, {"since_last_s": -1.0}, {"since_last_s": float("nan")}):
        args = {"interval_s": 1.0, "u": 0.5, **kw}
        with pytest.raises(ValueError, match=next(iter(kw)).replace("interval_s",
                                                                    "heartbeat_interval_s")):
            first_beat_delay(**args)


def _restarted(restart_every_s, restarts, interval_s=1.0):
    """A member's beats when its process restarts every ``restart_every_s`` seconds, the
    worst case of the offset: each new process beats at once (a follower's registration)
    and again at offset u = 0, then every interval until the next restart."""
    times = []
    for k in range(restarts):
        start = k * restart_every_s
        times += [start, start + first_beat_delay(interval_s, 0.0)]
        beat = start + interval_s
        while beat < start + restart_every_s:
            times.append(beat)
            beat += interval_s
    return times


def test_a_member_restarted_every_half_interval_is_never_refused():
    # Hand-computed (I = 1: 4 tokens per second, burst 8): each restart takes 2 at once and
    # the half interval to the next brings back 2, so the bucket goes 8 -> 6 -> 8 for ever.
    assert _refused(_restarted(0.5, 10_000), 1.0) == []
    for every in (0.75, 1.0, 1.5, 2.5, 7.0):  # longer lives beat once more per interval
        assert _refused(_restarted(every, 2_000), 1.0) == []


def test_a_member_restarted_faster_is_refused_at_the_hand_computed_beat():
    # Every 0.375 s (exact in binary): 2 taken, 1.5 back per restart. Before restart k (from
    # 1) the bucket holds 8 - 0.5 (k - 1) tokens; the second beat needs 2 of them: k <= 13
    # passes, restart 14's second beat (index 2 × 13 + 1 = 27) finds 1.5 - 1 = 0.5: refused.
    assert _refused(_restarted(0.375, 14), 1.0) == [27]
