"""The real leader (:class:`dips.roles.leader.Leader`, its threads included) on a clock the test
moves by hand, for comparisons of the simulator's decisions with the leader's.

Nothing depends on timing: a grace window closes, a push deadline passes and a heartbeat expires
only when the test advances :class:`ManualClock` (then the leader's loop sees the new time at
its next tick, which :meth:`advance` wakes at once), and every wait is for an event.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from dips.roles.leader import Leader


class ManualClock:
    """Seconds that move only when :meth:`advance` is called."""

    def __init__(self, start: float = 1000.0) -> None:
        self._t = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._t

    def advance(self, dt: float) -> None:
        with self._lock:
            self._t += dt


def wait_for(cond: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    """Poll ``cond`` until it returns a true value (returned); fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.01)


def advance(leader: Leader, clock: ManualClock, dt: float) -> None:
    """Move the leader's clock ``dt`` seconds on and wake its loop."""
    clock.advance(dt)
    with leader._cond:
        leader._cond.notify_all()


def slots(leader: Leader) -> dict[str, Any]:
    """The current round's slots (cluster -> Slot), {} without a round."""
    with leader._cond:
        rnd = leader._state.current
        return dict(rnd.slots) if rnd is not None else {}


def drop(leader: Leader, cluster_id: str) -> None:
    """Remove ``cluster_id`` as the leader's monitor does after its missed heartbeats."""
    with leader._cond:
        leader._drop_cluster(cluster_id, "heartbeat timeout")
