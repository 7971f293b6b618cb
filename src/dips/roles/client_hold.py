"""The hold of a cluster: no inner step while training could only be thrown away (review 15, #2);
and its heartbeats (:class:`HeartbeatMixin`), whose replies end what a hold waits for.

A mixin of :class:`dips.roles.client.ClusterClient` (which owns the counters, the backoff and
the sync); the rule is :func:`dips.algo.hold.hold`: a cluster holds while a re-join or a
verdict is pending, or once it trained ``hold_after`` sync intervals past its last completed
sync (the leader unreachable, the followers not ready). Holding, it keeps its model and its
data position, and tries again — what ``maintain`` does (re-join, ask again for the verdict,
retry the pull, lease) and the sync once its backoff allows — until it may train again.

Two ways to use it: :meth:`HoldMixin.hold_tick`, one short step of a hold (a training loop that
checks its own stop request and writes records between steps: ``dips cluster``), and
:meth:`HoldMixin.wait_while_held`, which blocks until the hold ends (a user's own loop:
:meth:`~dips.roles.client.ClusterClient.step_done` calls it unless ``wait=False``). The start
and the end of a hold are logged (a warning, with why; then how long it lasted).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import grpc

from dips.algo.hold import BACKOFF_FIRST_S, Hold, hold
from dips.algo.ratelimit import first_beat_delay
from dips.algo.refusal import Refusal
from dips.roles import failpoints
from dips.roles.cluster import SyncResult
from dips.wire.control import refusal_of
from dips.wire.pb import control_pb2 as pb

log = logging.getLogger(__name__)


@dataclass
class HoldEvent:
    """The start (``kind = "hold"``) or the end (``"hold_end"``) of a hold.

    Attributes:
        kind: ``hold`` or ``hold_end``.
        reason: why it held (:class:`dips.algo.hold.Hold`'s reason), for people.
        steps_since_sync: inner steps since the last completed sync when it began.
        held_s: seconds it lasted (``hold_end`` only; 0.0 at the start).
        sync: the sync (or verdict asked again) of the try that ended it (``hold_end``; None:
            it ended otherwise, e.g. by a re-join or the stop request).
        last_failure: the last failure that made it retry (for people).
    """

    kind: str
    reason: str
    steps_since_sync: int
    held_s: float = 0.0
    sync: SyncResult | None = None
    last_failure: str = ""


class HoldMixin:
    """The hold of :class:`dips.roles.client.ClusterClient` (module docstring)."""

    cluster_id: str
    H: int
    hold_after: int | None
    inner_step: int
    finished: str
    last_failure: str
    _last_sync_step: int
    _retry_at: float
    _rejoin: threading.Event
    _stop: threading.Event
    _pending_verdict: object | None
    #: One try of a held cluster (:meth:`dips.roles.client.ClusterClient.retry`).
    retry: Callable[[], SyncResult | None]
    _hold: HoldEvent | None = None       # the hold in progress (its start)
    _hold_t0: float = 0.0                 # when it began (monotonic seconds)
    _hold_sync: SyncResult | None = None  # what the last try gave (a sync, a verdict, None)

    def held(self) -> Hold | None:
        """Whether this cluster must hold now (:func:`dips.algo.hold.hold` of its counters, its
        pending re-join and verdict, its backoff and the monotonic clock); None: it may train."""
        return hold(max(0, self.inner_step - self._last_sync_step), self.H, self.hold_after,
                    rejoin_pending=self._rejoin.is_set(),
                    verdict_pending=self._pending_verdict is not None,
                    now=time.monotonic(), retry_at=self._retry_at)

    @property
    def holding(self) -> bool:
        """Whether a hold is in progress (begun by :meth:`hold_tick`, not yet ended)."""
        return self._hold is not None

    def hold_tick(self) -> tuple[bool, HoldEvent | None]:
        """One short step of a hold: (may it train now, the hold's start or end if it is now).

        Not held: ``(True, None)``, or ``(True, end)`` once when a hold just ended. Held: the
        first tick returns ``(False, start)`` at once; each later one waits on the stop request
        for the hold's ``wait_s`` (at most :data:`dips.algo.hold.POLL_S`), tries again
        (:meth:`retry`) and returns ``(False, None)``. A stop request or the run's end ends
        the hold: ``(True, end)``, and the caller's loop ends on its own test.
        """
        h = None if self._stop.is_set() or self.finished else self.held()
        if h is None:
            if self._hold is None:
                return True, None
            start, self._hold = self._hold, None
            end = HoldEvent("hold_end", start.reason, start.steps_since_sync,
                            time.monotonic() - self._hold_t0, self._hold_sync,
                            start.last_failure)
            self._hold_sync = None
            log.info("cluster %s: hold ended after %.1f s (%s)", self.cluster_id, end.held_s,
                     "synced" if end.sync is not None and end.sync.ok else
                     "stopping" if self._stop.is_set() or self.finished else "may train again")
            return True, end
        if self._hold is None:
            self._hold = HoldEvent("hold", h.reason, h.steps_since_sync,
                                   last_failure=self.last_failure)
            self._hold_t0, self._hold_sync = time.monotonic(), None
            log.warning("cluster %s: holding training (%s; %d inner steps since the last "
                        "completed sync, H = %d; last failure: %s): trying again until it "
                        "syncs, its data position kept", self.cluster_id, h.reason,
                        h.steps_since_sync, self.H, self.last_failure or "-")
            return False, self._hold
        if h.wait_s > 0:
            self._stop.wait(h.wait_s)
        self._hold_sync = self.retry()  # the hold's end names it if this try ended it
        return False, None

    def wait_while_held(self) -> SyncResult | None:
        """Block while this cluster must hold (ticks of :meth:`hold_tick`), until it may
        train, ``stop`` is set or the run finished. Returns the last sync tried meanwhile
        (None: none)."""
        last = None
        while True:
            go, event = self.hold_tick()
            if event is not None and event.kind == "hold_end":
                last = event.sync
            if go:
                return last
            last = self._hold_sync or last


class HeartbeatMixin:
    """The heartbeat thread of :class:`dips.roles.client.ClusterClient`: a report to the
    leader every ``_hb_interval`` seconds (inner step, tokens, last loss) that keeps the
    cluster a member. Its reply ends what a hold waits for: an unknown or revoked member
    sets the re-join; a leader heard again after failures makes the next try come now
    instead of after the backoff; a finished run sets ``finished``. It runs from the
    leader's answer to the join on, through the pull and any resume (review 26, M6).

    Its first beat comes :func:`dips.algo.ratelimit.first_beat_delay` after it starts: at a
    random offset within the interval (``beat_offset``, uniform in [0, 1) from the OS's
    random source), so that clusters joining together do not beat in the same second ever
    after (issue 16), and never sooner than one interval after this process's previous beat
    (a thread started again after a failed join)."""

    #: Draws u in [0, 1) for the first beat's offset (a test may set its own).
    beat_offset: Callable[[], float] = random.SystemRandom().random

    cluster_id: str
    inner_step: int
    tokens_total: int
    last_loss: float
    finished: str
    leader_version: int
    _leader: Any
    _hb_interval: float | None
    _hb_stop: threading.Event
    _hb_thread: threading.Thread | None
    _hb_last: float | None = None  # when this process last sent a heartbeat (monotonic s)
    _followers_epoch: int | None
    _rejoin: threading.Event
    _retry_at: float
    _backoff_s: float

    def _start_heartbeat(self) -> None:
        """Start the thread (no-op while one runs)."""
        if self._hb_thread is not None:
            return
        interval = self._hb_interval or 1.0
        since = None if self._hb_last is None else max(0.0, time.monotonic() - self._hb_last)
        first = first_beat_delay(interval, self.beat_offset(), since)

        def beat(stop: threading.Event = self._hb_stop) -> None:
            failing = False
            wait_s = first
            while not stop.wait(wait_s):
                wait_s = self._hb_interval or 1.0
                if failpoints.link_down():
                    failing = True
                    continue
                self._hb_last = time.monotonic()
                try:
                    reply = self._leader.Heartbeat(pb.HeartbeatRequest(
                        cluster_id=self.cluster_id, inner_step=self.inner_step,
                        tokens=self.tokens_total, last_loss=self.last_loss),
                        timeout=max(self._hb_interval or 1.0, 1.0))
                    self._followers_epoch = reply.followers_epoch
                    self.leader_version = reply.version
                    if reply.finished and not self.finished:
                        self.finished = f"the run finished ({reply.finished})"
                    if not reply.known:
                        self._rejoin.set()
                    if failing:  # the leader is back: retry now instead of after the backoff
                        self._retry_at, self._backoff_s = 0.0, BACKOFF_FIRST_S
                    failing = False
                except grpc.RpcError as exc:
                    failing = True
                    if refusal_of(exc) is Refusal.FORBIDDEN:
                        self._rejoin.set()  # revoked? the re-join says so for good
                    log.debug("heartbeat failed: %s", exc.code().name)

        self._hb_thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
        self._hb_thread.start()

    def _stop_heartbeat(self) -> None:
        """Stop the thread (if any) and wait up to 5 s for it; a later join starts a new one."""
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(5.0)
        self._hb_thread, self._hb_stop = None, threading.Event()
