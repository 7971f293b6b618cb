"""The push streams a data server is receiving on its consumer thread (:class:`PushStreams`;
:mod:`dips.wire.dataplane`; its pull streams: :mod:`dips.wire.pullstreams`).

Each stream is a BEGIN, its chunks and an END (:mod:`dips.wire.stream`); between them the
role's sink (:class:`~dips.wire.serving.PushSink`) takes each verified chunk. Every message
is handled on its own: whatever one raises fails that stream only (its sink is aborted and
the sender gets one error reply with a typed code), so no input stops the consumer (issue 13).
A connection may hold at most :data:`~dips.wire.serving.MAX_OPEN_STREAMS` streams open (BUSY
beyond), may not reuse the id of one still open, and a stream idle for ``stale_s`` seconds is
aborted (its sender died), as is one whose sink the role revoked (its round closed:
STALE_GRANT). The streams open per connection are what lets its chunks past the io thread's
gate (:meth:`PushStreams.open_on`).
"""
from __future__ import annotations

import time
from typing import Callable

import zmq

from dips.algo.refusal import Refusal, Refused
from dips.wire.dataclient import MSG
from dips.wire.frames import FrameError, encode
from dips.wire.keys import MemberKey
from dips.wire.seal import TAG_BYTES
from dips.wire.serving import (
    MAX_OPEN_STREAMS,
    REFUSED,
    Authorize,
    Incidents,
    PushSink,
    StreamHandler,
    error_reply,
)
from dips.wire.stream import MAX_CHUNK_BYTES, StreamReader


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
