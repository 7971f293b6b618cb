"""The streams a data server is receiving and sending (:mod:`dips.wire.dataplane`): push
streams on its consumer thread (:class:`PushStreams`), pull streams on its producer thread
(:class:`PullStreams`).

Each stream is a BEGIN, its chunks and an END (:mod:`dips.wire.stream`); between them the
role's sink (:class:`~dips.wire.serving.PushSink`) takes each verified chunk. Every message
is handled on its own: whatever one raises fails that stream only (its sink is aborted and
the sender gets one error reply with a typed code), so no input stops the consumer (issue 13).
A connection may hold at most :data:`~dips.wire.serving.MAX_OPEN_STREAMS` streams open (BUSY
beyond), may not reuse the id of one still open, and a stream idle for ``stale_s`` seconds is
aborted (its sender died), as is one whose sink the role revoked (its round closed:
STALE_GRANT).

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
from dips.wire.dataclient import MSG, xfer_id
from dips.wire.frames import FrameError, decode, encode
from dips.wire.keys import MemberKey
from dips.wire.seal import TAG_BYTES, SealRing
from dips.wire.serving import (
    MAX_OPEN_STREAMS,
    PULL_WINDOW_BYTES,
    PULL_WINDOW_MESSAGES,
    REFUSED,
    Authorize,
    Incidents,
    PullLedger,
    PullSource,
    PushSink,
    StreamHandler,
    error_reply,
)
from dips.wire.stream import CHUNK, MAX_CHUNK_BYTES, StreamReader, StreamWriter, check_chunk_bytes



class _Xfer:
    def __init__(self, reader: StreamReader, sink: PushSink, key: bytes) -> None:
        self.reader, self.sink, self.key = reader, sink, key
        self.failed, self.seen = False, time.monotonic()


class PushStreams:
    """The open push streams of one data server (used by its consumer thread only).

    Args:
        streams: opens a sink per stream (None: every stream is refused).
        authorize: ``(sender identity, header)``, raising Refused(FORBIDDEN).
        check_member: raises Refused(NOT_JOINED) for a key that is no longer a member's.
        incident: logs an exception that is no refusal (a bug an input found).
        stale_s: seconds after which an idle stream is aborted.
    """

    def __init__(self, streams: StreamHandler | None, authorize: Authorize,
                 check_member: Callable[[MemberKey], None], incident: Incidents,
                 stale_s: float) -> None:
        self._streams, self._authorize, self._check_member = streams, authorize, check_member
        self._incident, self._stale_s = incident, stale_s
        self._xfers: dict[tuple[bytes, bytes], _Xfer] = {}
        self._conns: dict[bytes, int] = {}  # connection -> streams open on it
        self._scratch = memoryview(bytearray(MAX_CHUNK_BYTES))  # decrypted chunks
        #: Called with ``(connection id, header)`` of every stream opened (or None).
        self.seen: Callable[[bytes, dict], None] | None = None

    def _abort(self, x: _Xfer, reason: str) -> None:
        """Abort a transfer's sink; a sink that fails to abort must not stop the thread."""
        x.failed = True
        try:
            x.sink.abort(reason)
        except Exception as exc:
            self._incident("abort", exc)

    def _fail(self, out: zmq.Socket, ident: bytes, x: _Xfer, exc: BaseException) -> None:
        if isinstance(exc, REFUSED):
            self._incident.refusals.refused(exc)
        else:
            self._incident("push", exc)
        self._abort(x, str(exc) if isinstance(exc, REFUSED) else f"internal error: {exc!r}")
        out.send_multipart(error_reply(x.key, ident, exc, x.reader.xfer), copy=False)

    def begin(self, out: zmq.Socket, ident: bytes, mk: MemberKey, frames: list) -> None:
        """A BEGIN ``[key id, head, mac]`` from ``ident`` under ``mk``: open its sink, or reply
        with the refusal."""
        reader = None
        try:
            if len(frames) != 3:
                raise FrameError(f"begin message has {len(frames)} frames, expected 3")
            if self._streams is None:
                raise ValueError("this data server does not accept streams")
            reader = StreamReader(mk.key, bytes(frames[1]), bytes(frames[2]),
                                  require_encrypted=mk.encrypt)
            self._check_member(mk)
            self._authorize(mk.identity, reader.header)
            if (ident, reader.xfer) in self._xfers:  # its sink must not be replaced unseen
                raise FrameError(f"stream field 'xfer' = {reader.xfer.hex()} is already open")
            if sum(1 for k in self._xfers if k[0] == ident) >= MAX_OPEN_STREAMS:
                raise Refused(Refusal.BUSY, f"{MAX_OPEN_STREAMS} push streams already open on "
                                            "this connection: finish one first")
            sink = self._streams.open_push(reader.header, reader.specs)
            self._xfers[(ident, reader.xfer)] = _Xfer(reader, sink, mk.key)
            self._conns[ident] = self._conns.get(ident, 0) + 1
            if self.seen is not None:
                self.seen(ident, reader.header)
        except Exception as exc:
            if isinstance(exc, REFUSED):
                self._incident.refusals.refused(exc)
            else:
                self._incident("begin", exc)
            out.send_multipart(error_reply(mk.key, ident, exc, reader and reader.xfer), copy=False)

    def chunk(self, out: zmq.Socket, ident: bytes, meta: bytes, tag: bytes,
              frame: zmq.Frame | None) -> None:
        """A CHUNK (``frame`` None: it was not ``[kind, meta, tag, data]``)."""
        x = self._xfers.get((ident, meta[:16]))
        if x is None or x.failed:
            return  # the rest of a refused or forgotten stream
        x.seen = time.monotonic()
        try:
            if frame is None:
                raise FrameError("chunk message is not [kind, meta, tag, data]")
            if len(frame) > MAX_CHUNK_BYTES + TAG_BYTES:
                raise FrameError(f"chunk data is {len(frame)} bytes, the limit is "
                                 f"{MAX_CHUNK_BYTES + TAG_BYTES}")
            # Verified bytes straight from the frame; decrypted into the scratch buffer
            # when the member encrypts (the sink copies them out before the next chunk).
            index, offset, view = x.reader.receive(meta, tag, frame.buffer, self._scratch)
            x.sink.write(index, offset, view)
        except Exception as exc:
            self._fail(out, ident, x, exc)

    def end(self, out: zmq.Socket, ident: bytes, frames: list) -> None:
        """An END ``[meta, mac]``: commit the sink and reply with its header, or refuse."""
        meta = bytes(frames[0][:64]) if frames else b""
        x = self._pop((ident, meta[:16]))
        if x is None or x.failed:
            return
        try:
            if len(frames) != 2:
                raise FrameError(f"end message has {len(frames)} frames, expected 2")
            x.reader.end(meta, bytes(frames[1][:64]))
            reply = x.sink.commit()
            out.send_multipart([ident, MSG, *encode(x.key, {**reply, "xfer": x.reader.xfer.hex()})],
                               copy=False)
        except Exception as exc:
            self._fail(out, ident, x, exc)

    def purge(self, out: zmq.Socket | None = None) -> None:
        """Abort the streams idle for more than ``stale_s`` seconds, and drop those whose
        sink the role revoked (refused STALE_GRANT on ``out``, if given)."""
        now = time.monotonic()
        for k, x in list(self._xfers.items()):
            if not x.failed and getattr(x.sink, "revoked", False):
                self._pop(k)
                exc = Refused(Refusal.STALE_GRANT, "the push's round closed while this stream "
                                                   "was open")
                self._abort(x, str(exc))
                if out is not None:
                    out.send_multipart(error_reply(x.key, k[0], exc, x.reader.xfer), copy=False)
            elif now - x.seen > self._stale_s:
                self._pop(k)
                if not x.failed:
                    self._abort(x, f"stream idle for more than {self._stale_s} s")

    def _pop(self, k: tuple[bytes, bytes]) -> _Xfer | None:
        """Forget stream ``k`` (its connection's count of open streams follows)."""
        x = self._xfers.pop(k, None)
        if x is not None:
            left = self._conns.get(k[0], 0) - 1
            if left > 0:
                self._conns[k[0]] = left
            else:
                self._conns.pop(k[0], None)
        return x

    @property
    def open(self) -> int:
        """Streams open (failed ones included until their END or ``stale_s``)."""
        return len(self._xfers)

    def open_on(self, ident: bytes) -> int:
        """Streams open on connection ``ident`` (read by the io thread without a lock: one
        dictionary read)."""
        return self._conns.get(ident, 0)

    def close(self) -> None:
        """Abort every open stream (the server stops)."""
        for x in self._xfers.values():
            if not x.failed:
                self._abort(x, "data server stopped")
        self._xfers.clear()
        self._conns.clear()


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
