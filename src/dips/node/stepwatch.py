"""A stalled inner step ends a multi-rank cluster (review 14, F1; §3 of the seed: a cluster's
failure stays a local event).

Every inner step of a torchrun cluster is a collective (DDP's gradient all-reduce, FSDP2's
gathers, the pipeline's sends). A rank that hangs or is stopped (a wedged GPU, SIGSTOP) holds
the others inside it until the in-cluster collective timeout (``collective_timeout_s``, 1800 s
by default, sized for rank 0's talks with the leader), while rank 0's heartbeat thread keeps
the cluster a member: the leader sees it alive and never pushing, its leased data idle.

:class:`StepWatch` bounds one inner step instead: rank 0 times each step (and the
collectives every rank meets once per step outside it: the agreement before the step, the end
of rank 0's per-step commands after it), and once the current one has run longer than :func:`step_bound` of the steps before it (``factor`` × the
median of the recent ones, at least ``floor_s``; ``first_s`` until ``warmup`` steps are
measured: compilation, caches, the first collectives), it logs why and calls ``on_stall``
(by default ``os._exit(1)``: the other ranks' collectives then fail at once, torchrun ends
the job and the cluster is restarted like any failed cluster, resuming its inner state).
The torchrun cluster takes ``factor`` and ``floor_s`` from its entry in the run config
(``stall_factor``, ``stall_floor_s``: :class:`dips.spec.ClusterConfig`).
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections import deque
from typing import Any, Callable

log = logging.getLogger(__name__)

__all__ = ["StepWatch", "step_bound"]


def step_bound(recent: list[float], factor: float, floor_s: float, first_s: float,
               warmup: int) -> float:
    """The longest an inner step may take, seconds: ``first_s`` while fewer than ``warmup``
    steps are measured, else max(``floor_s``, ``factor`` × the median of ``recent``)."""
    if len(recent) < warmup:
        return first_s
    return max(floor_s, factor * statistics.median(recent))


class StepWatch:
    """Times the inner steps of ``step`` (a trainer's bound ``step`` method) in a daemon
    thread polling every ``poll_s`` seconds (module docstring).

    Args:
        step: the callable to time; :meth:`wrap` returns it wrapped.
        factor, floor_s, first_s, warmup: :func:`step_bound`; ``window``: steps in the median.
        on_stall: called once with the message when a step overruns (default: exit 1).
        clock: seconds, monotonic.
    """

    def __init__(self, factor: float = 20.0, floor_s: float = 60.0, first_s: float = 600.0,
                 warmup: int = 3, window: int = 50, poll_s: float = 1.0,
                 on_stall: Callable[[str], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.factor, self.floor_s, self.first_s, self.warmup = factor, floor_s, first_s, warmup
        self.recent: deque[float] = deque(maxlen=window)
        self.poll_s, self.clock = poll_s, clock
        self.on_stall = on_stall or _exit
        self.started: float | None = None
        self.what = "an inner step"  # what is being timed now (the message names it)
        self.fired = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def wrap(self, step: Callable[..., Any], what: str = "an inner step",
             record: bool = True) -> Callable[..., Any]:
        """``step`` timed under the same bound; starts the watching thread on the first call.
        ``what`` names it in the message; ``record``: its durations make the median (the
        inner step), else it is only bounded (the per-step collectives every rank meets
        outside the step: a rank stopped while it paces or logs holds rank 0 there; issue
        14 review 24, F1)."""
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="step-watch",
                                                daemon=True)
                self._thread.start()
            with self._lock:
                self.started, self.what = self.clock(), what
            try:
                return step(*args, **kwargs)
            finally:
                with self._lock:
                    if self.started is not None and record:
                        self.recent.append(self.clock() - self.started)
                    self.started = None
        return timed

    def check(self) -> str | None:
        """The stall message if the current step has overrun its bound (and calls
        ``on_stall`` with it, once), else None."""
        with self._lock:
            if self.started is None or self.fired:
                return None
            took, what = self.clock() - self.started, self.what
            bound = step_bound(list(self.recent), self.factor, self.floor_s, self.first_s,
                               self.warmup)
            if took <= bound:
                return None
            self.fired = True
        message = (f"{what} has run {took:.0f} s, over its bound of {bound:.0f} s "
                   f"({self.factor:g} x the median step, at least {self.floor_s:g} s): a rank "
                   "of this cluster is hung or stopped; this rank exits so the cluster restarts")
        log.error(message)
        self.on_stall(message)
        return message

    def close(self) -> None:
        """Stop watching."""
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.check()


def _exit(message: str) -> None:
    logging.shutdown()
    os._exit(1)
