"""The transfer threads of a rank's stage worker, and waiting for them (issue 14; §10).

A rank runs each transfer in a daemon thread: a sharded one beside the collectives of the
main thread (:class:`Beside`, :mod:`dips.roles.cluster_shards`), and every one under a
deadline (:func:`dips.roles.client_sync._in_threads`). A thread still running at its
deadline is left to its socket timeouts, and the rank goes on. Such a thread must end before
the process does: a daemon thread still inside a torch call when the interpreter exits
aborts the process (SIGABRT, "terminate called without an active exception" from
``std::terminate``), after all its work was done and reported. So the rank keeps them
(:class:`Stragglers`) and :meth:`dips.roles.cluster_ranks.RankWorker.close` waits for them
with a bound, raising rather than exiting over them.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

__all__ = ["Beside", "Stragglers"]


class Beside:
    """``transfer()`` run in the daemon thread ``thread`` (the caller runs the collectives
    meanwhile), then ``done()`` once it returned or raised."""

    def __init__(self, transfer: Callable[[], dict], done: Callable[[], None]) -> None:
        self._outcome: dict[str, dict] = {}

        def run() -> None:
            try:
                self._outcome["out"] = transfer()
            finally:
                done()

        self.thread = threading.Thread(target=run, name="sharded-transfer", daemon=True)
        self.thread.start()

    def wait(self, timeout_s: float) -> dict | None:
        """The transfer's outcome, or None if it raised or still runs after ``timeout_s``
        seconds (then ``thread`` must be joined before the process exits: :class:`Stragglers`)."""
        self.thread.join(timeout_s)
        return None if self.thread.is_alive() else self._outcome.get("out")


class Stragglers:
    """Transfer threads a rank stopped waiting for (they run on to their socket timeouts).

    :meth:`join` waits for every one before the process exits: a daemon thread still inside
    a torch call when the interpreter exits aborts the process (SIGABRT, "terminate called
    without an active exception"), after all its work was done. Thread-safe: a straggler may
    add the threads it in turn gave up on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def add(self, threads: list[threading.Thread]) -> None:
        """Keep ``threads`` (those still alive) until :meth:`join`."""
        with self._lock:
            self._threads = [t for t in self._threads + list(threads) if t.is_alive()]

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds (>= 0) for every thread kept, including those
        added meanwhile. Raises ValueError for a negative ``timeout_s`` and RuntimeError
        naming the threads still running at the bound (they would abort the process at
        its exit)."""
        if not timeout_s >= 0:
            raise ValueError(f"Stragglers.join: timeout_s = {timeout_s} must be >= 0")
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()]
                alive = list(self._threads)
            if not alive:
                return
            if (left := deadline - time.monotonic()) <= 0:
                raise RuntimeError(f"{len(alive)} transfer thread(s) still running "
                                   f"{timeout_s} s after the close: "
                                   f"{sorted(t.name for t in alive)}")
            alive[0].join(left)
