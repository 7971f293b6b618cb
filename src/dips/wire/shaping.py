"""Application-level link shaping: a blocking token bucket (the non-root fallback, §13).

When network namespaces and ``tc tbf`` are unavailable (not root), a sender calls
``bucket.consume(n)`` before putting ``n`` bytes on the wire, so its average rate cannot
exceed ``rate_bytes_per_s`` and its bursts ``burst_bytes``.  This shapes only what passes
through the caller (its upload); the kernel's tbf (:mod:`dips.emu.netns`) shapes both
directions.  Source: the classic token-bucket filter (tc-tbf(8), RFC 2697's token bucket).

A request larger than the bucket is never refused: it borrows (the level goes negative) and
the caller sleeps until the debt is repaid, so a 10 MB message through a 64 KB bucket takes
10 MB / rate.  Concurrent callers are served in arrival order: each reserves its bytes under
the lock and then sleeps for its own share, outside the lock.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

__all__ = ["TokenBucket"]


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


class TokenBucket:
    """Blocking token bucket; thread-safe.

    Args:
        rate_bytes_per_s: refill rate (bytes/s, finite, > 0).
        burst_bytes: capacity (bytes, finite, > 0); the bucket starts full.
        clock: monotonic clock in seconds (injected in tests).
        sleep: sleep function in seconds (injected in tests).

    Raises:
        ValueError: a non-positive or non-finite rate or burst (named with the value).
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: float,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._rate = _positive("rate_bytes_per_s", rate_bytes_per_s)
        self._burst = _positive("burst_bytes", burst_bytes)
        if not callable(clock) or not callable(sleep):
            raise ValueError(f"clock and sleep must be callables, got {clock!r}, {sleep!r}")
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._level = self._burst
        self._stamp = clock()
        self.consumed = 0
        """Bytes granted so far (int)."""

    @property
    def rate_bytes_per_s(self) -> float:
        """Current refill rate (bytes/s)."""
        return self._rate

    @property
    def burst_bytes(self) -> float:
        """Capacity (bytes)."""
        return self._burst

    def _refill(self, now: float) -> None:
        # Callers hold the lock.  A clock that steps backwards refills nothing.
        self._level = min(self._burst, self._level + max(0.0, now - self._stamp) * self._rate)
        self._stamp = max(self._stamp, now)

    def reserve(self, nbytes: int) -> float:
        """Take ``nbytes`` now and return the seconds to wait before sending them (>= 0).

        Raises ValueError for a negative or non-integer ``nbytes``.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        with self._lock:
            self._refill(self._clock())
            self._level -= nbytes
            self.consumed += nbytes
            return -self._level / self._rate if self._level < 0 else 0.0

    def consume(self, nbytes: int) -> float:
        """Block until ``nbytes`` may be sent; returns the seconds slept.

        Raises ValueError for a negative or non-integer ``nbytes`` (nothing is taken).
        """
        wait = self.reserve(nbytes)
        if wait > 0:
            self._sleep(wait)
        return wait

    def set_rate(self, rate_bytes_per_s: float) -> None:
        """Change the refill rate from now on (a slow-link schedule); tokens earned so far stay.

        Raises ValueError (rate unchanged) for a non-positive or non-finite rate.
        """
        rate = _positive("rate_bytes_per_s", rate_bytes_per_s)
        with self._lock:
            self._refill(self._clock())
            self._rate = rate
