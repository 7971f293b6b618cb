"""The stage-worker side of the ZeroMQ data plane (§5, §10, §12 of the seed).

One :class:`DataClient` is one DEALER connection to one follower's
:class:`~dips.wire.dataplane.DataServer`; it runs one operation at a time (not thread-safe:
each stage worker owns its clients). Message kinds (first frame):

Every request carries the sender's key id in clear right after the kind (``[kind, key id,
...]``, :mod:`dips.wire.keys`); replies are keyed with the same member key.

* ``M``: a single authenticated message of :mod:`dips.wire.frames`; every reply is one.
* ``B``/``C``/``E``: a chunked stream (:mod:`dips.wire.stream`); a push is answered by one
  ``M`` (ack or error) naming the stream's ``xfer`` id.
* ``R``: a pull request (an ``M``-encoded message with ``xfer`` and ``chunk``), answered by a
  stream, or by an ``M`` error at any point of it.

Several pushes may be in flight on one client (start them in order, finish them in any
order: replies are matched by ``xfer``). Sends are zero-copy (``copy=False``): a tensor
passed to :meth:`DataClient.push_start` must stay unchanged until its
:meth:`DataClient.push_finish` returns.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch
import zmq

from dips.algo.refusal import Refusal
from dips.wire.frames import MAX_HEADER_BYTES, FrameError, Message, decode, encode, tensor_bytes
from dips.wire.keys import MemberKey
from dips.wire.seal import TAG_BYTES, SealRing
from dips.wire.stream import (
    BEGIN,
    CHUNK,
    DEFAULT_CHUNK_BYTES,
    END,
    MAX_CHUNK_BYTES,
    StreamReader,
    StreamWriter,
    TensorSpec,
)

MSG, PULL = b"M", b"R"
#: The largest frame of a stream or of a header-only message (bytes): a chunk with its GCM
#: tag, or a header. A peer that exchanges only these needs no larger ``ZMQ_MAXMSGSIZE``.
STREAM_FRAME_BYTES = max(MAX_CHUNK_BYTES, MAX_HEADER_BYTES) + TAG_BYTES
#: Replies to other streams held while waiting for one (a follower answers each stream once).
_MAX_EARLY_REPLIES = 64


class DataPlaneError(RuntimeError):
    """The peer answered a data-plane request with an error.

    ``code``: the :class:`dips.algo.refusal.Refusal` the peer gave (control flow decides on
    it); the message is for people.
    """

    def __init__(self, message: str, code: Refusal = Refusal.UNSPECIFIED) -> None:
        super().__init__(message)
        self.code = code

    @classmethod
    def of(cls, endpoint: str, header: dict[str, Any]) -> "DataPlaneError":
        """The error of an ``{"op": "error"}`` reply header from ``endpoint``."""
        try:
            code = Refusal(header.get("code", 0))
        except (TypeError, ValueError):
            code = Refusal.UNSPECIFIED
        return cls(f"{endpoint}: {header.get('error')}", code)


def xfer_id(value: Any) -> bytes:
    """Parse a 16-byte transfer id from hex. Raises FrameError naming the value."""
    try:
        x = bytes.fromhex(value)
    except (TypeError, ValueError):
        x = b""
    if len(x) != 16:
        raise FrameError(f"field 'xfer' = {repr(value)[:80]} is not a 16-byte hex id")
    return x


class DataClient:
    """A DEALER socket to one follower's data server.

    Args:
        key: this member's data-plane key (from its join).
        endpoint: ``tcp://host:port`` of the follower.
        timeout_s: seconds to wait for each reply or message before ``TimeoutError``.
        limiter: called with a byte count before each message or chunk is sent (e.g.
            :meth:`dips.wire.shaping.TokenBucket.consume`, to emulate a slower link).
        max_message_bytes: the largest frame this client accepts (``ZMQ_MAXMSGSIZE``, bytes;
            at least :data:`STREAM_FRAME_BYTES`): a reply carrying whole tensors (a
            single-message pull) needs the largest of them. libzmq drops a connection that
            sends more before allocating it (the request then times out).
    """

    def __init__(self, key: MemberKey, endpoint: str, timeout_s: float = 60.0,
                 limiter: Callable[[int], Any] | None = None,
                 max_message_bytes: int = STREAM_FRAME_BYTES) -> None:
        self._key = key.key
        self._kid = key.key_id.encode()
        self._encrypt = key.encrypt
        self._ring = SealRing() if key.encrypt else None
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.limiter = limiter
        self.max_message_bytes = max(max_message_bytes, STREAM_FRAME_BYTES)
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._early: dict[str, Message] = {}

    def set_timeout(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` seconds for each reply or message from now on."""
        self.timeout_s = timeout_s
        if self._sock is not None:
            self._sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
            self._sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            sock.setsockopt(zmq.SNDHWM, 0)   # queued chunks are references, not copies
            sock.setsockopt(zmq.RCVHWM, 32)  # at most 32 chunks read ahead of the consumer
            sock.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
            sock.setsockopt(zmq.RCVTIMEO, int(self.timeout_s * 1000))
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def _send(self, parts: list, nbytes: int, track: bool = False) -> None:
        if self.limiter is not None:
            self.limiter(nbytes)
        tracker = self._socket().send_multipart(parts, copy=False, track=track)
        if track:
            self._ring.track(tracker)  # the ring's buffer is reused once ZeroMQ released it

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except zmq.Again:
            self.close()
            raise TimeoutError(f"no reply from {self.endpoint} within {self.timeout_s} s "
                               f"({what})") from None
        except BaseException:
            self.close()  # never read the rest of a broken exchange as a later reply
            raise

    def _reply(self, xfer: bytes | None, what: str) -> Message:
        msg = self._early.pop(xfer.hex(), None) if xfer is not None else None
        while msg is None:
            frames = self._socket().recv_multipart(copy=False)
            if not frames or frames[0].bytes != MSG:
                raise FrameError(f"expected a reply from {self.endpoint}, got kind "
                                 f"{frames[0].bytes[:8] if frames else b''!r} ({what})")
            msg = decode(self._key, [f.buffer for f in frames[1:]],
                         require_encrypted=self._encrypt)
            got = msg.header.pop("xfer", None)
            if xfer is not None and got is not None and got != xfer.hex():
                if len(self._early) >= _MAX_EARLY_REPLIES or not isinstance(got, str):
                    raise FrameError(f"reply to unknown stream {repr(got)[:40]} from "
                                     f"{self.endpoint} ({what})")
                self._early[got] = msg  # the reply to another stream still in flight
                msg = None
        if msg.header.get("op") == "error":
            raise DataPlaneError.of(self.endpoint, msg.header)
        return msg

    def request(self, header: dict[str, Any],
                tensors: Sequence[tuple[str, torch.Tensor]] = ()) -> Message:
        """Send one message and return the verified reply.

        Raises:
            TimeoutError: no reply within ``timeout_s`` (the socket is reset).
            DataPlaneError: the follower replied with an error.
            FrameError: bad input, or the reply failed verification.
        """
        def run() -> Message:
            frames = encode(self._key, header, tensors, encrypt=self._encrypt)
            self._send([MSG, self._kid, *frames], sum(memoryview(f).nbytes for f in frames))
            return self._reply(None, f"op {header.get('op')!r}")
        return self._guard(f"op {header.get('op')!r}", run)

    def push_start(self, header: dict[str, Any], tensors: Sequence[tuple[str, torch.Tensor]],
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> StreamWriter:
        """Queue a stream of ``tensors`` (contiguous BF16/FP32) in chunks; return its handle.

        Returns as soon as everything is queued (libzmq sends in the background).
        Raises FrameError for bad input, TimeoutError if the queue stays full.
        """
        def run() -> StreamWriter:
            w = StreamWriter(self._key, header, [TensorSpec.of(n, t) for n, t in tensors],
                             chunk_bytes, encrypt=self._encrypt, ring=self._ring)
            begin = w.begin()
            self._send([begin[0], self._kid, *begin[1:]], len(w.head))
            for i, (_, t) in enumerate(tensors):
                for parts in w.chunks(i, t):
                    self._send(parts, memoryview(parts[3]).nbytes, track=w.encrypted)
            self._send(w.end(), 64)
            return w
        return self._guard(f"push {header.get('op')!r}", run)

    def push_finish(self, pending: StreamWriter) -> dict[str, Any]:
        """Wait for the follower's reply to a stream; return its header.

        Raises TimeoutError, DataPlaneError (refused: the reason names the field), FrameError.
        """
        return self._guard("push reply", lambda: self._reply(pending.xfer, "push").header)

    def push(self, header: dict[str, Any], tensors: Sequence[tuple[str, torch.Tensor]],
             chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict[str, Any]:
        """:meth:`push_start` then :meth:`push_finish`."""
        return self.push_finish(self.push_start(header, tensors, chunk_bytes))

    def pull(self, header: dict[str, Any], out: Sequence[tuple[str, torch.Tensor]],
             chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict[str, Any]:
        """Request a stream and receive it straight into ``out`` (no intermediate copy).

        ``out`` lists the expected tensors in order (contiguous CPU tensors); the stream must
        announce exactly these names, dtypes and shapes. ``out`` holds partial data if an
        error is raised, so it must be a staging area, never live parameters.

        Returns the reply header. Raises TimeoutError, DataPlaneError (refused), FrameError
        (announced tensors differ, chunk out of order/wrong size/unauthenticated, truncated).
        """
        for n, t in out:
            if not t.is_contiguous():
                raise ValueError(f"pull destination {n!r} is not contiguous")
        want = [TensorSpec.of(n, t) for n, t in out]
        xfer = os.urandom(16)

        def run() -> dict[str, Any]:
            req = encode(self._key, {**header, "xfer": xfer.hex(), "chunk": chunk_bytes})
            self._send([PULL, self._kid, *req], sum(memoryview(f).nbytes for f in req))
            sock = self._socket()
            parts = sock.recv_multipart()
            if parts[0] == MSG:
                decode_reply = self._check_error(parts)
                raise FrameError(f"expected a stream from {self.endpoint}, got {decode_reply}")
            if parts[0] != BEGIN or len(parts) != 3:
                raise FrameError(f"expected a stream begin from {self.endpoint}, got kind "
                                 f"{parts[0][:8]!r} with {len(parts)} frames")
            reader = StreamReader(self._key, parts[1], parts[2],
                                  require_encrypted=self._encrypt)
            if reader.xfer != xfer:
                raise FrameError(f"stream {reader.xfer.hex()} answers another request")
            if reader.specs != want:
                raise FrameError(f"stream announces {[(s.name, s.dtype, s.shape) for s in reader.specs]}, "
                                 f"expected {[(s.name, s.dtype, s.shape) for s in want]}")
            dests = [tensor_bytes(t) for _, t in out]
            while True:
                kind = sock.recv()
                if kind == CHUNK and sock.getsockopt(zmq.RCVMORE):
                    meta = sock.recv()
                    i, off, n = reader.expect(meta)
                    tag = sock.recv()
                    view = dests[i][off:off + n]
                    if reader.encrypted:  # decrypted straight into the destination
                        reader.open_into(meta, sock.recv(copy=False).buffer, view)
                        continue
                    got = sock.recv_into(view)
                    if got != n:
                        raise FrameError(f"chunk {reader.received} of tensor {want[i].name!r} is "
                                         f"{got} bytes, expected {n}")
                    reader.verify(meta, tag, view)
                elif kind == END:
                    rest = sock.recv_multipart()
                    if len(rest) != 2:
                        raise FrameError(f"end message has {len(rest)} frames, expected 2")
                    reader.end(rest[0], rest[1])
                    return reader.header
                elif kind == MSG:
                    raise FrameError(f"stream interrupted: {self._check_error([kind, *sock.recv_multipart()])}")
                else:
                    raise FrameError(f"unexpected message kind {kind[:8]!r} inside a stream")
        return self._guard(f"pull {header.get('op')!r}", run)

    def _check_error(self, parts: list[bytes]) -> dict[str, Any]:
        msg = decode(self._key, parts[1:])
        if msg.header.get("op") == "error":
            raise DataPlaneError.of(self.endpoint, msg.header)
        return msg.header

    def __enter__(self) -> "DataClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._early.clear()
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
