"""The consumer's and the producer's loops of a data server (:mod:`dips.wire.dataplane`).

Each takes its work from its :class:`~dips.wire.intake.FairQueue` (filled by the io thread's
:class:`~dips.wire.gate.Gate`), one connection's oldest item at a time in turn, and posts
what it sends on its own PUSH socket to the io thread's outbox (zero-copy). Whatever one
item raises is a bug the input found (each handler answers its own refusals): it is logged
(:class:`~dips.wire.refusals.Incidents`) and loses that item, not the thread.
"""

from __future__ import annotations

import threading
import time

import zmq

from dips.wire.gate import Gate
from dips.wire.pushstreams import PullStreams, PushStreams
from dips.wire.refusals import Incidents
from dips.wire.serving import SEND_HWM
from dips.wire.single import SingleMessages
from dips.wire.stream import BEGIN, CHUNK, END

#: Seconds the producer waits for a stream's window to open before it looks for new requests.
WAIT_S = 0.005
#: Pull requests the producer answers before it pumps its streams again.
INTAKE = 64


def _outbox(ctx: zmq.Context, addr: str, hwm: int | None = None) -> zmq.Socket:
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 0)
    if hwm is not None:
        out.setsockopt(zmq.SNDHWM, hwm)
    out.connect(addr)
    return out


def consume(ctx: zmq.Context, outbox: str, gate: Gate, pushes: PushStreams,
            single: SingleMessages, incident: Incidents, stop: threading.Event,
            poll_s: float) -> None:
    """The consumer: push streams (BEGIN, chunks, END) and single messages, until ``stop``;
    every ``poll_s`` seconds (also under a steady flow) it purges stale or revoked streams
    and writes the refusals' log line if one is due."""
    out = _outbox(ctx, outbox)
    purge_at = 0.0
    try:
        while not stop.is_set():
            got = gate.inq.get(poll_s)
            if got is not None:
                try:
                    _dispatch(out, gate, pushes, single, got[1])
                except Exception as exc:
                    incident("consumer", exc)
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
            incident: Incidents, stop: threading.Event, poll_s: float) -> None:
    """The producer: answers pull requests (each connection in turn) and pumps the pull
    streams, until ``stop``."""
    out = _outbox(ctx, outbox, SEND_HWM)  # streams are windowed: the HWM only paces a burst
    try:
        while not stop.is_set():
            first = None
            if not pulls.active:  # nothing to send: wait for a request
                first = gate.pullq.get(poll_s)
                if first is None:
                    pulls.release_written()
                    continue
            _intake(out, gate, pulls, incident, first)
            try:
                moved = pulls.pump(out)
            except Exception as exc:  # each stream answers its own failure; a bug here
                incident("producer", exc)
                moved = True
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


__all__ = ["INTAKE", "WAIT_S", "consume", "produce"]
