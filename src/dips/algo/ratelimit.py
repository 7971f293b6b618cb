"""A token bucket: how many calls of one kind one member may make per second (issue 13,
review 25 M1: a member calling ``GetStatus`` in a loop from 6 threads made 1,093 calls/s and
took 0.64 of a core of the leader; honest outer steps went 0.77x as fast).

A bucket holds up to ``burst`` tokens and gains ``rate`` tokens per second; a call takes one
and is refused when less than one is left. Pure: the time is passed in (seconds of any
monotonic clock), so the real leader and a test drive it alike.
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["Bucket", "check_rate", "take"]


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
