"""The pull streams a data server is sending on its producer thread (:class:`PullStreams`;
:mod:`dips.wire.dataplane`; its push streams: :mod:`dips.wire.pushstreams`).

Pull streams are sent only as fast as their peers take them (issue 13: a member that pulls
and never reads): each is produced a chunk at a time, at most
:data:`~dips.wire.serving.PULL_WINDOW_BYTES` (and ``PULL_WINDOW_MESSAGES``) ahead of what
libzmq has written to its connection, and within its member's budget
(:class:`~dips.wire.serving.PullLedger`); many streams are produced in turn, so a peer that
does not read stalls only its own. A stream that could send nothing for ``stall_s`` seconds
is dropped and its source released (what libzmq already holds for it stays counted against
its member, the stream still in flight, until the peer reads it or disconnects).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Iterator

import zmq

from dips.algo.refusal import Refusal, Refused
from dips.wire.dataclient import xfer_id
from dips.wire.frames import FrameError, decode
from dips.wire.keys import MemberKey
from dips.wire.seal import SealRing
from dips.wire.serving import (
    PULL_WINDOW_BYTES,
    PULL_WINDOW_MESSAGES,
    REFUSED,
    Authorize,
    Incidents,
    PullLedger,
    PullSource,
    StreamHandler,
    error_reply,
)
from dips.wire.stream import CHUNK, StreamWriter, check_chunk_bytes


class _Pull:
    """One pull stream being produced (see :class:`PullStreams`): its source and writer, the
    next tensor, the chunks of the current one, and ``window``: ``(tracker, bytes)`` of each
    message handed to libzmq and not yet released, oldest first (``queued`` bytes)."""

    def __init__(self, ident: bytes, member: str, key: bytes, src: PullSource,
                 writer: StreamWriter, now: float) -> None:
        self.ident, self.member, self.key = ident, member, key
        self.src: PullSource | None = src
        self.writer = writer
        self.index = 0
        self.chunks: Iterator[list[Any]] = iter(())
        self.window: deque = deque()
        self.queued = 0
        self.moved = now
        self.ended = False  # its END was handed over
        self.closed = False  # it sends nothing more (see PullStreams._end)
        self.tail: Any = None  # the tracker of its last message, once it ended complete


class PullStreams:
    """The pull streams of one data server (used by its producer thread only).

    :meth:`open` answers a pull request at once: its BEGIN (and as much of it as its window
    allows), or a typed refusal (BUSY beyond its member's limits). :meth:`pump` sends what
    each stream's window allows, in turn, and drops streams stalled for ``stall_s``;
    :meth:`wait` waits for a window to open.

    Args:
        streams, authorize, check_member, incident: as for :class:`PushStreams`.
        ledger: the members' pull accounting (shared with single-message pulls).
        stall_s: seconds a stream may send nothing (its peer reads nothing) before it is dropped.
        window_bytes, window_messages: a stream's credit window (see the module docstring).

    Attributes:
        dropped: streams dropped because their peer did not read.
        ring: the buffers of encrypted chunks (:class:`~dips.wire.seal.SealRing`).
    """

    def __init__(self, streams: StreamHandler | None, authorize: Authorize,
                 check_member: Callable[[MemberKey], None], incident: Incidents,
                 ledger: PullLedger, stall_s: float, window_bytes: int = PULL_WINDOW_BYTES,
                 window_messages: int = PULL_WINDOW_MESSAGES) -> None:
        self._streams, self._authorize, self._check_member = streams, authorize, check_member
        self._incident, self._ledger, self._stall_s = incident, ledger, stall_s
        self._window_bytes, self._window_messages = window_bytes, window_messages
        self._active: list[_Pull] = []
        # Ended streams whose last messages libzmq still holds: zero-copy views of their
        # source's snapshot, so the source stays open (a reader) until they are written.
        self._pinned: list[_Pull] = []
        self._reaped = 0.0
        self.ring = SealRing()
        self.dropped = 0

    @property
    def active(self) -> int:
        """Streams being produced."""
        return len(self._active)

    def queued(self) -> int:
        """Bytes the streams being produced handed to libzmq and it still holds."""
        return sum(p.queued for p in self._active)

    def open(self, out: zmq.Socket, ident: bytes, mk: MemberKey, frames: list) -> None:
        """A pull request ``[key id, header, mac]`` from ``ident`` under ``mk``: start its
        stream, or reply with the refusal."""
        member, xfer, admitted, src, p = mk.identity.name, None, False, None, None
        try:
            if len(frames) != 3:
                raise FrameError(f"pull request has {len(frames)} frames, expected 3 (key id, "
                                 "header, mac)")
            msg = decode(mk.key, frames[1:])
            xfer = xfer_id(msg.header.pop("xfer", None))
            chunk = check_chunk_bytes(msg.header.pop("chunk", None))
            self._check_member(mk)
            self._authorize(mk.identity, msg.header)
            if self._streams is None:
                raise ValueError("this data server does not serve streams")
            self._supersede(out, member, msg.header.get("version"))
            self._ledger.admit(member, stream=True)
            admitted = True
            src = self._streams.open_pull(msg.header)
            writer = StreamWriter(mk.key, src.header, src.specs, chunk, xfer=xfer,
                                  encrypt=mk.encrypt, ring=self.ring)
            p = _Pull(ident, member, mk.key, src, writer, time.monotonic())
            self._send(out, p, writer.begin())
        except Exception as exc:
            if p is not None:
                self._end(p)
            elif admitted:
                _close_source(src, self._incident)
                self._ledger.finish(member, deque(), stream=True)
            self._refuse(out, ident, mk.key, exc, xfer)
            return
        self._active.append(p)
        self._pump(out, p, time.monotonic())  # a small stream leaves at once

    def pump(self, out: zmq.Socket) -> bool:
        """Send what every stream's window allows, in turn; drop the stalled ones. Returns
        whether anything was sent or released."""
        now = time.monotonic()
        if now - self._reaped > 0.05:
            self._ledger.reap()
            self.release_written()
            self._reaped = now
        moved = False
        for p in list(self._active):
            moved = self._pump(out, p, now) or moved
        return moved

    def wait(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for libzmq to release the oldest message of the stream
        that moved last (the one most likely to move again). False if no stream has a
        message in flight (nothing to wait for here)."""
        waiting = [p for p in self._active if p.window]
        if not waiting:
            return False
        try:
            max(waiting, key=lambda p: p.moved).window[0][0].wait(timeout_s)
        except zmq.NotDone:
            pass
        return True

    def close(self) -> None:
        """Stop every stream (the server stops)."""
        for p in list(self._active):
            self._end(p)
        self._unpin(lambda p: True)

    def release_written(self) -> None:
        """Release the sources of the ended streams whose last message libzmq released."""
        self._unpin(lambda p: p.tail is None or p.tail.done)

    def _unpin(self, done: Callable[[_Pull], bool]) -> None:
        """Close the sources of the ended streams for which ``done(stream)`` holds."""
        for p in [p for p in self._pinned if done(p)]:
            self._pinned.remove(p)
            src, p.src = p.src, None
            _close_source(src, self._incident)

    def _supersede(self, out: zmq.Socket, member: str, version: Any) -> None:
        """End ``member``'s streams of versions older than ``version`` (its new pull's): a
        stage worker pulls one version at a time, so a stream of an older version is one its
        peer gave up. Each stream still being produced is answered VERSION_GONE; the snapshot
        of each, produced or not, is released (what libzmq still holds of it may then change
        under it: its peer gave it up). Review 20, P: a member that opened a pull per version
        and read none pinned a whole-shard BF16 snapshot set per stream. Only ``member``'s own
        streams are touched, whatever ``version`` is."""
        if not isinstance(version, int) or isinstance(version, bool):
            return  # the pull itself is refused by name (INVALID_ARGUMENT)
        self._unpin(lambda p: p.member == member and _older(p, version))
        for p in [p for p in self._active if p.member == member and _older(p, version)]:
            old = p.src.header.get("version")
            self._end(p)
            self._refuse(out, p.ident, p.key, Refused(
                Refusal.VERSION_GONE, f"pull stream of version {old} ended: a pull of "
                                      f"version {version} by the same member followed it"),
                p.writer.xfer)

    # ----- one stream ---------------------------------------------------------------------
    def _pump(self, out: zmq.Socket, p: _Pull, now: float) -> bool:
        moved = False
        try:
            moved = self._settle(p, now)
            while (not p.ended and p.queued < self._window_bytes
                   and len(p.window) < self._window_messages and self._ledger.room(p.member)):
                self._send(out, p, self._next(p))
                moved = True
            if p.ended:
                self._end(p, written_first=True)
            elif now - p.moved > self._stall_s:
                self.dropped += 1
                self._incident.refusals("pull_stalled", f"pull stream of {p.member!r} dropped: "
                                        f"its peer read nothing for {self._stall_s:.0f} s")
                self._end(p)
                self._refuse(out, p.ident, p.key, Refused(
                    Refusal.BUSY, f"pull stream dropped: nothing read for {self._stall_s} s"),
                    p.writer.xfer, quiet=True)
        except Exception as exc:
            self._end(p)
            self._refuse(out, p.ident, p.key, exc, p.writer.xfer)
        return moved

    def _settle(self, p: _Pull, now: float) -> bool:
        """Uncount what libzmq released of ``p``'s window (in order: one connection)."""
        freed = 0
        while p.window and p.window[0][0].done:
            freed += p.window.popleft()[1]
        if freed:
            p.queued -= freed
            p.moved = now
            self._ledger.written(p.member, freed)
        return freed > 0

    def _next(self, p: _Pull) -> list[Any]:
        """``p``'s next message: a chunk, or after the last one its END."""
        while True:
            parts = next(p.chunks, None)
            if parts is not None:
                return parts
            if p.index < len(p.src.specs):
                p.chunks = p.writer.chunks(p.index, p.src.tensor(p.index))
                p.index += 1
                continue
            p.src.finish()  # raises if the version changed meanwhile: no END then
            p.ended = True
            return p.writer.end()

    def _send(self, out: zmq.Socket, p: _Pull, parts: list[Any]) -> None:
        """Hand one message of ``p`` to libzmq (zero-copy), its last frame tracked."""
        nbytes = sum(memoryview(x).nbytes for x in parts)
        last = zmq.Frame(parts[-1], track=True, copy=False)
        tracker = out.send_multipart([p.ident, *parts[:-1], last], copy=False, track=True)
        del last  # libzmq's reference alone keeps the frame: released once written
        if p.writer.encrypted and parts[0] == CHUNK:
            self.ring.track(tracker)  # the ring's buffer is reused once libzmq released it
        p.window.append((tracker, nbytes))
        p.queued += nbytes
        p.moved = time.monotonic()
        self._ledger.handed(p.member, nbytes)

    def _end(self, p: _Pull, written_first: bool = False) -> None:
        """``p`` sends nothing more; what libzmq holds of it stays counted against its member
        until released. Its source is released now, or with ``written_first`` (it ended
        complete) once libzmq released its last message: its chunks are views of the
        source's snapshot, which a newer version would otherwise recycle under a slow peer
        (found by ``test_a_slow_pullers_bytes_are_not_recycled_before_they_are_written``).
        Idempotent."""
        if p.closed:
            return
        p.closed = True
        if p in self._active:
            self._active.remove(p)
        p.chunks = iter(())
        if written_first and p.window:
            p.tail = p.window[-1][0]  # released last: the connection writes in order
            self._pinned.append(p)
        else:
            src, p.src = p.src, None
            _close_source(src, self._incident)
        self._ledger.finish(p.member, p.window, stream=True)
        p.window = deque()
        p.queued = 0

    def _refuse(self, out: zmq.Socket, ident: bytes, key: bytes, exc: BaseException,
                xfer: bytes | None, quiet: bool = False) -> None:
        if quiet:  # the stream's end, already counted as what ended it
            pass
        elif isinstance(exc, REFUSED):
            self._incident.refusals.refused(exc)  # counted; a flood does not flood the log
        else:
            self._incident("pull", exc)
        out.send_multipart(error_reply(key, ident, exc, xfer), copy=False)


def _older(p: _Pull, version: int) -> bool:
    old = p.src.header.get("version") if p.src is not None else None
    return isinstance(old, int) and old < version


def _close_source(src: Any, incident: Incidents) -> None:
    close = getattr(src, "close", None)
    if close is not None:
        try:
            close()
        except Exception as exc:
            incident("pull close", exc)
