"""A log that writes at most one line per key per interval (review 21, F3).

A refused input from a peer must not cost a log line each: a member (or, on the data plane, a
stranger) that sends refused requests in a loop made ``leader.log`` grow 109 to 195 KB/s and a
follower's log 2.8 to 3.7 MB/s. Count such inputs in a metric, and log them through
:class:`RateLimitedLog`: the first line of a key (e.g. ``(peer, reason)``) is written at once,
the next ones within ``interval_s`` are only counted, and the first line after the interval
says how many were left out. Used by the leader's control plane and the followers' data plane.

    limited = RateLimitedLog(log, interval_s=60.0)
    limited.warning(("cluster-c", "NOTHING_TRAINED"), "refused %s: %s", who, why)

:func:`printable` makes a peer's text safe to write to a log or a terminal (review 21, F4).
:class:`Tally` counts refusals for the metric (``dips_refusals_total`` at the leader), under the
same bound on its keys.

The keys it remembers are bounded (:data:`MAX_KEYS`, plus the overflow key): once full, keys
whose interval has passed are forgotten, and a new key while none has shares one overflow key
(:data:`OVERFLOW`), so a peer that varies its key cannot grow the memory or the
log either. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Hashable

__all__ = ["MAX_KEYS", "OVERFLOW", "RateLimitedLog", "Tally", "printable"]

#: Keys remembered at once (besides :data:`OVERFLOW`).
MAX_KEYS = 1024
#: The key of every line whose own key found no room.
OVERFLOW = ("(other keys)",)


def printable(s: str) -> str:
    """``s`` with every character that is not printable replaced: whitespace (newline, tab)
    by a space, anything else (control characters incl. ESC, so no terminal escape sequence
    survives; format characters such as bidirectional overrides; unassigned code points) by
    U+FFFD. Rich markup such as ``[/x]`` is left as it is: renderers show it as text
    (``rich.text.Text``), never as markup. Linear in ``len(s)``; cut long text first."""
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else " " if c.isspace() else "\ufffd" for c in s)


class RateLimitedLog:
    """At most one line per key per ``interval_s`` seconds to ``logger``.

    Args:
        logger: where lines go.
        interval_s: seconds between two lines of one key (> 0).
        clock: seconds, monotonic (tests pass their own).
        max_keys: keys remembered at once (>= 1).

    Raises:
        ValueError: ``interval_s`` <= 0 or ``max_keys`` < 1.
    """

    def __init__(self, logger: logging.Logger, interval_s: float,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = MAX_KEYS) -> None:
        if not interval_s > 0 or max_keys < 1:
            raise ValueError(f"interval_s = {interval_s} must be > 0 and max_keys = {max_keys} "
                             ">= 1")
        self.logger, self.interval_s, self._clock, self._max = logger, interval_s, clock, max_keys
        self._lock = threading.Lock()
        self._keys: dict[Hashable, list[float | int]] = {}  # key -> [last written, left out]

    def log(self, level: int, key: Hashable, msg: str, *args: Any) -> bool:
        """Write ``msg % args`` at ``level`` unless a line of ``key`` was written less than
        ``interval_s`` ago (then it is only counted). A written line after left-out ones ends
        with how many were left out. Returns whether the line was written."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self._clock()
        with self._lock:
            key = self._room(key, now)
            slot = self._keys.get(key)
            if slot is not None and now - slot[0] < self.interval_s:
                slot[1] += 1
                return False
            left_out = int(slot[1]) if slot is not None else 0
            self._keys[key] = [now, 0]
        if left_out:
            msg = f"{msg} (and {left_out} more like it in the last {self.interval_s:g} s)"
        self.logger.log(level, msg, *args)
        return True

    def _room(self, key: Hashable, now: float) -> Hashable:
        """``key``, or :data:`OVERFLOW` when no room is left for a new key (lock held)."""
        if key in self._keys or len(self._keys) < self._max:
            return key
        for k in [k for k, (t, _) in self._keys.items() if now - t >= self.interval_s]:
            del self._keys[k]  # (its count of left-out lines goes with it)
        return key if len(self._keys) < self._max else OVERFLOW

    def debug(self, key: Hashable, msg: str, *args: Any) -> bool:
        """:meth:`log` at DEBUG."""
        return self.log(logging.DEBUG, key, msg, *args)

    def info(self, key: Hashable, msg: str, *args: Any) -> bool:
        """:meth:`log` at INFO."""
        return self.log(logging.INFO, key, msg, *args)

    def warning(self, key: Hashable, msg: str, *args: Any) -> bool:
        """:meth:`log` at WARNING."""
        return self.log(logging.WARNING, key, msg, *args)


class Tally:
    """Counts per key (e.g. ``(member, method, reason)`` of refused calls), thread-safe; at
    most ``max_keys`` keys, the counts of any further key go to :data:`OVERFLOW` (one more).

    Raises:
        ValueError: ``max_keys`` < 1.
    """

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys = {max_keys} must be >= 1")
        self._max = max_keys
        self._lock = threading.Lock()
        self._counts: dict[Hashable, int] = {}

    def add(self, key: Hashable, n: int = 1) -> None:
        """Count ``n`` more of ``key``."""
        with self._lock:
            if key not in self._counts and len(self._counts) >= self._max:
                key = OVERFLOW
            self._counts[key] = self._counts.get(key, 0) + n

    def counts(self) -> dict[Hashable, int]:
        """A copy of the counts (key -> count since this tally was made)."""
        with self._lock:
            return dict(self._counts)
