"""A token bucket: how many calls of one kind one member may make per second (issue 13,
review 25 M1: a member calling ``GetStatus`` in a loop from 6 threads made 1,093 calls/s and
took 0.64 of a core of the leader; honest outer steps went 0.77x as fast).

A bucket holds up to ``burst`` tokens and gains ``rate`` tokens per second; a call takes one
and is refused when less than one is left. Pure: the time is passed in (seconds of any
monotonic clock), so the real leader and a test drive it alike.

Heartbeats (issue 13, review 30: 1,014 heartbeats/s of one member were served, the leader at
0.65 cores) get a bucket derived from the run's heartbeat interval I
(:func:`heartbeat_limit`): :data:`HEARTBEAT_RATE_FACTOR` / I per second after a burst of
:data:`HEARTBEAT_BURST`. An honest member sends its next heartbeat I after the previous one
was answered or timed out (``dips.roles.client_hold``, the follower's registration loop), so
the leader takes the answered ones at least I apart; a sequence whose times at the leader
each lie within ±J of a period-I schedule conforms while 2J <= (HEARTBEAT_BURST - 1) · I
(7 intervals of jitter, or 7 unanswered beats that arrive at once after a stall of the
leader), whatever its length (``tests/algo/test_ratelimit.py``, hand-computed).

When a member beats (issue 16): members that start together (a launch, a leader restart's
re-registrations) would beat in the same second for as long as they live — the §16 run's
leader got all 25 members' heartbeats in one second every interval, 1,120 at 1,024
clusters. So a heartbeat loop's first beat comes at a random offset, ``u × I`` with u
uniform in [0, 1) from the member's own random source (:func:`first_beat_delay`), and every
I after it: the members' beats spread uniformly over the interval,
and the interval, hence the §12 detection, is unchanged. A cluster's first beat follows its
join, which set the leader's last-heard time, so the silence before it is under I: with the
leader's limit of ``missed_heartbeats × I`` (3 I by default) at least 2 intervals of slack
remain (the old first beat, one full I after the join, left exactly 2). The rate limit and a
restart: a loop started again in the same process beats no sooner than I after that
process's previous beat (``since_last_s``), so only a new process adds a beat to the
period-I schedule (a follower registers at once when it starts and beats again at u × I,
both at once for u = 0). A member restarted at most every I / 2 still has at least 6 tokens
at each restart (each restart takes at most 2 at once, a lifetime R ≥ I / 2 brings back
4 R / I ≥ 2; a longer one takes 1 more per I and brings back 4), so it is never refused;
restarted every 3 I / 8 it would be, at its 14th restart (8 − 0.5 × 13 = 1.5 tokens before
it: the second beat finds 0.5).
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["Bucket", "HEARTBEAT_BURST", "HEARTBEAT_RATE_FACTOR", "check_rate", "first_beat_delay",
           "heartbeat_limit", "take"]

#: Heartbeats per heartbeat interval one member may send, sustained (an honest one sends 1).
HEARTBEAT_RATE_FACTOR = 4.0
#: Heartbeats one member may send at once after a quiet while.
HEARTBEAT_BURST = 8


class Bucket(NamedTuple):
    """Tokens left (float, 0..burst) as of ``at`` (seconds, the caller's clock)."""

    tokens: float
    at: float


def check_rate(rate: float, burst: float) -> None:
    """Raise ValueError naming the field unless ``rate`` (tokens per second) is > 0 and
    finite and ``burst`` (tokens) is >= 1 and finite."""
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate {rate!r} must be a finite number > 0 (calls per second)")
    if not (math.isfinite(burst) and burst >= 1):
        raise ValueError(f"burst {burst!r} must be a finite number >= 1 (calls)")


def take(bucket: Bucket | None, now: float, rate: float, burst: float) -> tuple[Bucket, bool]:
    """Take one token from ``bucket`` (None: a new, full one) at time ``now`` (seconds).

    Returns the bucket after the call and whether the call may go on. A refused call takes
    nothing. A clock that went back adds nothing (the bucket keeps its later time).

    Raises:
        ValueError: ``rate`` or ``burst`` out of range (:func:`check_rate`).
    """
    check_rate(rate, burst)
    if bucket is None:
        tokens, at = float(burst), now
    else:
        at = max(bucket.at, now)
        tokens = min(float(burst), bucket.tokens + (at - bucket.at) * rate)
    if tokens >= 1.0:
        return Bucket(tokens - 1.0, at), True
    return Bucket(tokens, at), False


def heartbeat_limit(interval_s: float) -> tuple[float, float]:
    """(rate per second, burst) of one member's heartbeats in a run whose members beat every
    ``interval_s`` seconds (``membership.heartbeat_interval_s``): several times an honest
    member's rate, so that jitter and a leader's stall never refuse one (module docstring).

    Raises:
        ValueError: ``interval_s`` not a finite number > 0 (naming it).
    """
    if not (isinstance(interval_s, (int, float)) and math.isfinite(interval_s) and interval_s > 0):
        raise ValueError(f"heartbeat_interval_s {interval_s!r} must be a finite number > 0 "
                         "(seconds)")
    return HEARTBEAT_RATE_FACTOR / interval_s, float(HEARTBEAT_BURST)


def first_beat_delay(interval_s: float, u: float, since_last_s: float | None = None) -> float:
    """Seconds from the start of a heartbeat loop (a cluster's join answered, a follower's
    registration at its start) to its first beat: ``u × interval_s``, but never less than
    ``interval_s − since_last_s`` when the same process beat ``since_last_s`` seconds ago
    (module docstring, "When a member beats"; issue 16).

    Args:
        interval_s: the heartbeat interval I (seconds, finite, > 0).
        u: a draw uniform in [0, 1) from the member's own random source.
        since_last_s: seconds since this process's previous beat (>= 0); None: none yet.

    Raises:
        ValueError: a value out of range, naming it.
    """
    if not (isinstance(interval_s, (int, float)) and math.isfinite(interval_s) and interval_s > 0):
        raise ValueError(f"heartbeat_interval_s {interval_s!r} must be a finite number > 0 "
                         "(seconds)")
    if not (isinstance(u, (int, float)) and 0.0 <= u < 1.0):
        raise ValueError(f"heartbeat offset u {u!r} must be a number in [0, 1)")
    delay = u * interval_s
    if since_last_s is not None:
        if not (isinstance(since_last_s, (int, float)) and since_last_s >= 0):
            raise ValueError(f"since_last_s {since_last_s!r} must be a number >= 0 (seconds)")
        delay = max(delay, interval_s - since_last_s)
    return delay

