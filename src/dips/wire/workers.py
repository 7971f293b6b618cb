"""The consumer's and the producer's loops of a data server (:mod:`dips.wire.dataplane`), and
the single-message requests the consumer answers (:class:`SingleMessages`: a push of one
layer, or a pull whose whole reply is one message).

Each takes its work from its :class:`~dips.wire.intake.FairQueue` (filled by the io thread's
:class:`~dips.wire.gate.Gate`), one connection's oldest item at a time in turn, and posts
what it sends on its own PUSH socket to the io thread's outbox (zero-copy). Whatever one
item raises is a bug the input found (each handler answers its own refusals): it is logged
(:class:`~dips.wire.refusals.Incidents`) and loses that item, not the thread.

A single-message pull is admitted by its member's pull budget
(:class:`~dips.wire.serving.PullLedger`, BUSY beyond) and its reply counted against it until
libzmq wrote it. Its reply is built whole on the consumer thread, so it is capped
(:data:`~dips.wire.serving.SINGLE_REPLY_BYTES`, the member's pull budget; review 21: a
148-byte request for a 38 MB shard held 28 MB and 0.6 s of the consumer): a role refuses a
larger one before building it (a follower: INVALID_ARGUMENT naming ``layers``, to be pulled as
a stream), and a reply over the cap that a role built all the same is refused here.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from typing import Any

import zmq

from dips.algo.refusal import Refusal, Refused
from dips.wire.dataclient import MSG
from dips.wire.frames import decode, encode
from dips.wire.gate import Gate
from dips.wire.keys import MemberKey
from dips.wire.pullstreams import PullStreams
from dips.wire.pushstreams import PushStreams
from dips.wire.refusals import Incidents
from dips.wire.serving import (
    REFUSED,
    SEND_HWM,
    SINGLE_REPLY_BYTES,
    Authorize,
    Handler,
    PullLedger,
    PushConnections,
    error_reply,
)
from dips.wire.stream import BEGIN, CHUNK, END

#: Seconds the producer waits for a stream's window to open before it looks for new requests.
WAIT_S = 0.005
#: Pull requests the producer answers before it pumps its streams again.
INTAKE = 64


class SingleMessages:
    """Answers single messages (used by the consumer thread only).

    Args:
        handler: ``Message -> (reply header, tensors)`` (see :class:`DataServer`).
        authorize, check_member, incident: as for :class:`~dips.wire.pushstreams.PushStreams`.
        pulls: the members' pull budgets (shared with pull streams).
        push_conns: where an accepted push's connection is noted.
        reply_bytes: the largest single-message reply (bytes).
    """

    def __init__(self, handler: Handler, authorize: Authorize, check_member, incident: Incidents,
                 pulls: PullLedger, push_conns: PushConnections,
                 reply_bytes: int = SINGLE_REPLY_BYTES) -> None:
        self._handler, self._authorize, self._check_member = handler, authorize, check_member
        self._incident, self._pulls, self._push_conns = incident, pulls, push_conns
        self.reply_bytes = reply_bytes

    def answer(self, out: zmq.Socket, ident: bytes, mk: MemberKey, frames: list) -> None:
        """Answer ``frames`` (``[key id, header, mac, payloads...]``) from ``ident`` under
        ``mk``: the handler's reply, or a typed refusal (counted, never one log line each)."""
        pull = False
        try:
            msg = decode(mk.key, frames[1:], require_encrypted=mk.encrypt)
            self._check_member(mk)
            self._authorize(mk.identity, msg.header)
            if msg.header.get("op") == "pull":
                self._pulls.admit(mk.identity.name, stream=False)
                pull = True
            header, tensors = self._handler(msg)
            if pull:
                size = sum(t.numel() * t.element_size() for _, t in tensors)
                if size > self.reply_bytes:
                    raise Refused(Refusal.INVALID_ARGUMENT, f"a single-message pull of {size} "
                                  f"bytes exceeds {self.reply_bytes}: pull it as a stream")
            if msg.header.get("op") == "push":
                self._push_conns.note(ident, msg.header)
            reply = [ident, MSG, *encode(mk.key, header, tensors, encrypt=mk.encrypt)]
        except REFUSED as exc:
            if pull:  # admitted, then refused: nothing of it is held
                self._pulls.finish(mk.identity.name, deque(), stream=False)
            pull = False
            self._incident.refusals.refused(exc)
            reply = error_reply(mk.key, ident, exc)
        except Exception as exc:  # keep serving other peers; report the failure
            pull = False
            self._incident("request", exc)
            reply = error_reply(mk.key, ident, exc)
        if not pull:
            out.send_multipart(reply, copy=False)
            return
        nbytes = sum(memoryview(f).nbytes for f in reply[1:])
        last = zmq.Frame(reply[-1], track=True, copy=False)
        tracker = out.send_multipart([*reply[:-1], last], copy=False, track=True)
        del last, reply  # libzmq's reference alone keeps the reply: released once written
        self._pulls.handed(mk.identity.name, nbytes)
        self._pulls.finish(mk.identity.name, deque([(tracker, nbytes)]), stream=False)


class BusyTime:
    """Seconds a follower was busy, by phase, since the last :meth:`take` (monotonic clock;
    thread-safe): ``push`` (the consumer verifying push chunks and answering single
    messages), ``pull`` (the producer answering pull requests and sending pull streams),
    ``update`` (the leader's control calls: score, aggregate, apply, commit, restore). Each
    phase has its own thread, so the phases may add up to more than the span.

    Also over the process's life (:meth:`totals`) and the last :data:`IDLE_WINDOW_S` seconds
    (:meth:`idle_ratio`, the metrics'; review 28 of issue 15, #6). ``clock``: monotonic
    seconds (a test's)."""

    PHASES = ("update", "push", "pull")
    #: The window of :meth:`idle_ratio` (seconds).
    IDLE_WINDOW_S = 60.0

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._busy = dict.fromkeys(self.PHASES, 0.0)
        self._total = dict.fromkeys(self.PHASES, 0.0)
        self._since = self._started = clock()
        self._recent: deque[list[float]] = deque()  # [whole second, busy seconds in it]

    def add(self, phase: str, seconds: float) -> None:
        """``seconds`` more of ``phase`` (one of :data:`PHASES`), ending now."""
        s = max(0.0, seconds)
        now = self._clock()
        with self._lock:
            self._busy[phase] += s
            self._total[phase] += s
            sec = float(int(now))
            if self._recent and self._recent[-1][0] == sec:
                self._recent[-1][1] += s
            else:
                self._recent.append([sec, s])
            while self._recent and self._recent[0][0] < now - self.IDLE_WINDOW_S - 1.0:
                self._recent.popleft()

    def totals(self) -> dict[str, float]:
        """Busy seconds by phase since this process started (never reset)."""
        with self._lock:
            return dict(self._total)

    def idle_ratio(self) -> float:
        """The fraction of the last :data:`IDLE_WINDOW_S` seconds (or of the time since the
        start, if shorter) not busy in any phase: 1 − Σ busy / wall time, at least 0 (the
        phases' threads may overlap; the same sum as ``dips report``'s followers.png)."""
        now = self._clock()
        window = min(self.IDLE_WINDOW_S, now - self._started)
        if window <= 0:
            return 1.0
        with self._lock:
            busy = sum(b for sec, b in self._recent if sec + 1.0 > now - window)
        return max(0.0, 1.0 - busy / window)

    def take(self) -> dict[str, Any]:
        """``{"busy_s": {phase: seconds}, "span_s": seconds since the last take}``, and start
        counting again."""
        now = self._clock()
        with self._lock:
            busy, self._busy = self._busy, dict.fromkeys(self.PHASES, 0.0)
            span, self._since = now - self._since, now
        return {"busy_s": {k: round(v, 6) for k, v in busy.items()}, "span_s": round(span, 6)}


def _outbox(ctx: zmq.Context, addr: str, hwm: int | None = None) -> zmq.Socket:
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 0)
    if hwm is not None:
        out.setsockopt(zmq.SNDHWM, hwm)
    out.connect(addr)
    return out


def consume(ctx: zmq.Context, outbox: str, gate: Gate, pushes: PushStreams,
            single: SingleMessages, incident: Incidents, stop: threading.Event,
            poll_s: float, busy: BusyTime | None = None) -> None:
    """The consumer: push streams (BEGIN, chunks, END) and single messages, until ``stop``;
    every ``poll_s`` seconds (also under a steady flow) it purges stale or revoked streams
    and writes the refusals' log line if one is due. ``busy``: where the time of each
    message's work goes (phase ``push``)."""
    out = _outbox(ctx, outbox)
    purge_at = 0.0
    try:
        while not stop.is_set():
            got = gate.inq.get(poll_s)
            if got is not None:
                started = time.monotonic()
                try:
                    _dispatch(out, gate, pushes, single, got[1])
                except Exception as exc:
                    incident("consumer", exc)
                if busy is not None:
                    busy.add("push", time.monotonic() - started)
            now = time.monotonic()
            if now >= purge_at:
                purge_at = now + poll_s
                try:
                    pushes.purge(out)
                    incident.refusals.flush()
                except Exception as exc:
                    incident("purge", exc)
    finally:
        pushes.close()
        out.close(0)


def _dispatch(out: zmq.Socket, gate: Gate, pushes: PushStreams, single: SingleMessages,
              item: tuple) -> None:
    ident, kind = item[0], item[1]
    if kind == CHUNK:
        try:
            pushes.chunk(out, ident, *item[2:])
        finally:
            gate.chunk_done()
    elif kind == END:  # [meta, mac]: the stream's key was found at its BEGIN
        pushes.end(out, ident, item[2])
    elif kind == BEGIN:
        try:
            pushes.begin(out, ident, item[2], item[3])
        finally:  # after it opened: its chunks find it open
            gate.begin_done(ident)
    else:
        single.answer(out, ident, item[2], item[3])


def produce(ctx: zmq.Context, outbox: str, gate: Gate, pulls: PullStreams,
            incident: Incidents, stop: threading.Event, poll_s: float,
            busy: BusyTime | None = None) -> None:
    """The producer: answers pull requests (each connection in turn) and pumps the pull
    streams, until ``stop``. ``busy``: where the time of that work goes (phase ``pull``; the
    waits for a request or for a member's budget are idle)."""
    out = _outbox(ctx, outbox, SEND_HWM)  # streams are windowed: the HWM only paces a burst
    try:
        while not stop.is_set():
            first = None
            if not pulls.active:  # nothing to send: wait for a request
                first = gate.pullq.get(poll_s)
                if first is None:
                    pulls.release_written()
                    continue
            started = time.monotonic()
            _intake(out, gate, pulls, incident, first)
            try:
                moved = pulls.pump(out)
            except Exception as exc:  # each stream answers its own failure; a bug here
                incident("producer", exc)
                moved = True
            if busy is not None:
                busy.add("pull", time.monotonic() - started)
            if not moved and pulls.active and not pulls.wait(WAIT_S):
                # every stream waits for its member's budget: look for requests
                _intake(out, gate, pulls, incident, gate.pullq.get(WAIT_S))
    finally:
        pulls.close()
        out.close(0)


def _intake(out: zmq.Socket, gate: Gate, pulls: PullStreams, incident: Incidents,
            first: tuple | None) -> None:
    """Answer the pull requests waiting (up to :data:`INTAKE`, ``first`` the first of them):
    each stream begins, or is refused, at once."""
    got = first
    for _ in range(INTAKE):
        if got is None:
            got = gate.pullq.get(0)
            if got is None:
                return
        ident, _, mk, frames = got[1]
        got = None
        try:
            pulls.open(out, ident, mk, frames)
        except Exception as exc:  # refusals are answered inside; this is a bug
            incident("producer", exc)


__all__ = ["INTAKE", "WAIT_S", "BusyTime", "SingleMessages", "consume", "produce"]
