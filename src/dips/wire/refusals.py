"""How a data server refuses without doing work for the refused (issue 13, review 21 F1/F3):
every refusal is counted by reason, and the log gets at most one line per interval.

A peer chooses how many messages it sends, so nothing a data server does per refused message
may grow with them but a counter: :class:`Refusals` counts each refusal under a short reason
(``unknown_key``, ``too_large``, ``queue_full``, a :class:`~dips.algo.refusal.Refusal` code's
name such as ``busy`` or ``invalid_argument``, ...; :data:`REASONS` lists the data plane's own)
and writes one WARNING line per ``interval_s`` seconds at most, summing what it refused since
the last line and quoting one example. The counts are the follower's Prometheus counter
``dips_data_plane_refused_total{reason}`` (:mod:`dips.node.metrics_members`).

:class:`Incidents` logs an exception that is no refusal (a bug an input found): its traceback
once per (where, exception type), every repeat is counted as ``internal`` instead.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from dips.algo.refusal import Refusal, Refused

log = logging.getLogger("dips.wire.dataplane")

#: The reasons the data plane refuses for before any role sees a message (io thread), and
#: those of its own streams; a role's typed refusal counts under its code's lower-case name.
REASONS = {
    "unknown_kind": "the first frame is no message kind of the data plane",
    "malformed": "too few frames for its kind",
    "key_id": "the key id is not '<identity>/<32 hex digits>'",
    "no_secret": "this follower has no data secret yet (not registered)",
    "unknown_key": "the key id is no current member's (never issued, or long retired)",
    "too_many_frames": "more frames than its kind carries",
    "too_large": "more bytes than its kind carries on this shard",
    "queue_full": "its connection's queue is full (messages or bytes)",
    "evicted": "dropped from the fullest connection's queue to make room for another's",
    "unknown_stream": "a chunk or end on a connection with no push stream open",
    "pull_stalled": "a pull stream whose peer read nothing for too long",
    "internal": "a bug the input found (again)",
}
#: Seconds between two log lines of refusals, at least.
LOG_INTERVAL_S = 10.0
#: Longest example quoted in a log line (characters).
_EXAMPLE_CHARS = 200


def reason_of(exc: BaseException) -> str:
    """The reason a refusal raised as ``exc`` counts under: its Refusal code's name in lower
    case (``busy``, ``not_joined``, ...), ``invalid_argument`` for any other ValueError."""
    if isinstance(exc, Refused):
        return exc.code.name.lower()
    if isinstance(exc, ValueError):
        return Refusal.INVALID_ARGUMENT.name.lower()
    return "internal"


class Refusals:
    """Counts refusals by reason and logs at most one line per ``interval_s`` (thread-safe).

    Args:
        interval_s: seconds between log lines, at least.
        clock: monotonic seconds (tests pass a fake one).

    Attributes:
        lines: log lines written so far.
    """

    def __init__(self, interval_s: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._total: dict[str, int] = {}
        self._since: dict[str, int] = {}  # refused since the last line
        self._example = ""
        self._logged_at: float | None = None
        self.lines = 0

    def __call__(self, reason: str, detail: object = "") -> None:
        """Count one refusal of ``reason``; ``detail`` (an exception or text, cut to 200
        characters and ASCII-escaped: peer text) is the example a log line may quote."""
        with self._lock:
            self._total[reason] = self._total.get(reason, 0) + 1
            self._since[reason] = self._since.get(reason, 0) + 1
            if not self._example:
                self._example = ascii(str(detail)[:_EXAMPLE_CHARS]) if detail else reason
        self.flush()

    def refused(self, exc: BaseException) -> None:
        """Count a typed refusal (:func:`reason_of`), quoting its text."""
        self(reason_of(exc), exc)

    def flush(self, force: bool = False) -> None:
        """Write the line of what was refused since the last one, if ``interval_s`` passed
        since that line (or ``force``). Cheap when there is nothing to write."""
        if not self._since:
            return
        with self._lock:
            now = self._clock()
            if not self._since or (not force and self._logged_at is not None
                                   and now - self._logged_at < self.interval_s):
                return
            counts = ", ".join(f"{r} {n}" for r, n in sorted(self._since.items()))
            example, span = self._example, (0.0 if self._logged_at is None
                                            else now - self._logged_at)
            self._since, self._example, self._logged_at = {}, "", now
            self.lines += 1
        log.warning("data plane refused %s message(s) in the last %.0f s; e.g. %s", counts,
                    span, example)

    def counts(self) -> dict[str, int]:
        """Refusals per reason since the start."""
        with self._lock:
            return dict(self._total)

    def total(self, reason: str | None = None) -> int:
        """Refusals of ``reason`` (None: of every reason) since the start."""
        with self._lock:
            if reason is None:
                return sum(self._total.values())
            return self._total.get(reason, 0)


class Incidents:
    """Logs unexpected exceptions (bugs a message found): the traceback once per (where,
    exception type); a repeat is counted in ``refusals`` as ``internal`` (rate-limited), so
    a peer repeating the input cannot fill the log."""

    def __init__(self, refusals: Refusals | None = None) -> None:
        self._seen: set[tuple[str, str]] = set()
        self.refusals = refusals or Refusals()

    def __call__(self, where: str, exc: BaseException) -> None:
        key = (where, type(exc).__name__)
        if key in self._seen:
            self.refusals("internal", f"data-plane {where} failed again: "
                                      f"{type(exc).__name__}: {str(exc)[:120]}")
            return
        if len(self._seen) < 256:
            self._seen.add(key)
        log.error("data-plane %s failed (refused UNSPECIFIED, serving on)", where, exc_info=exc)


__all__ = ["LOG_INTERVAL_S", "REASONS", "Incidents", "Refusals", "reason_of"]
