"""ZeroMQ data plane: stage workers <-> followers (§5, §10, §12 of the seed).

A follower binds one ROUTER socket served by three threads, so bulk data never waits behind
itself and never holds a lock that control calls (gRPC, another socket and thread pool) or
checkpoint writes need:

* ``data-io`` owns the socket: it takes each chunk as the ZeroMQ frame libzmq received it into
  (``copy=False``: the kernel's copy is the only one) and passes it on, holding one of a fixed
  number of credits per chunk (it blocks when they are spent, so a fast sender meets
  back-pressure: libzmq stops reading at ``RCVHWM``, then TCP's window closes), and forwards
  outgoing messages that the other two threads post on an in-process socket (zero-copy).
* ``data-consumer`` verifies each chunk of a push (:class:`~dips.wire.stream.StreamReader`) and
  hands the verified bytes, still in the received frame, to the role's sink (the follower
  forms Δ from them) while later chunks still arrive; then it drops the frame and returns the
  credit. It also serves single-message requests (the ``handler``).
* ``data-producer`` serves pull streams: it asks the role for each tensor in turn (the
  follower converts the next layer to BF16 while libzmq sends the current one) and queues its
  chunks without copying them.

Every request names its sender's key id in clear (``[kind, key id, ...]``); the server
derives that member's key (:class:`~dips.wire.keys.Keyring`), verifies the request with it,
answers with it, and asks ``authorize`` whether that member may do that (a follower lets a
cluster push only as itself). Keys are per member: no two members share one.

A :class:`DataClient` (one DEALER socket, one operation at a time) sends single messages
(:meth:`~DataClient.request`, the codec of :mod:`dips.wire.frames`), pushes streams
(:meth:`~DataClient.push`) and receives pull streams straight into caller-provided tensors
(:meth:`~DataClient.pull`). Every blocking call has a timeout; after any failure the client's
socket is closed and recreated, so no stale message is ever read as a reply.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Protocol, Sequence

import torch
import zmq

from dips.algo.refusal import Refusal, Refused
from dips.wire.dataclient import MSG, PULL, DataClient, DataPlaneError
from dips.wire.dataclient import xfer_id as _xfer_id
from dips.wire.frames import FrameError, Message, decode, encode
from dips.wire.keys import Keyring, MemberKey
from dips.wire.pki import Identity
from dips.wire.seal import TAG_BYTES, SealRing
from dips.wire.stream import (
    BEGIN,
    CHUNK,
    END,
    MAX_CHUNK_BYTES,
    StreamReader,
    StreamWriter,
    TensorSpec,
    check_chunk_bytes,
)

log = logging.getLogger(__name__)
_OUTBOX_IDS = itertools.count()

Handler = Callable[[Message], tuple[dict[str, Any], Sequence[tuple[str, torch.Tensor]]]]
#: ``authorize(sender, header)``: raise Refused(FORBIDDEN) if ``sender`` may not send it.
Authorize = Callable[[Identity, dict[str, Any]], None]


def _allow_all(sender: Identity, header: dict[str, Any]) -> None:
    return None


class PushSink(Protocol):
    """Where the chunks of one pushed transfer go (called from the consumer thread)."""

    def write(self, index: int, offset: int, data: memoryview) -> None: ...
    def commit(self) -> dict[str, Any]: ...
    def abort(self, reason: str) -> None: ...


class PullSource(Protocol):
    """What one pull stream sends: ``header``, ``specs``, then ``tensor(i)`` for each spec;
    ``finish()`` raises ValueError if what was sent is no longer valid (then no END is sent)."""

    header: dict[str, Any]
    specs: list[TensorSpec]

    def tensor(self, index: int) -> torch.Tensor: ...
    def finish(self) -> None: ...


class StreamHandler(Protocol):
    def open_push(self, header: dict[str, Any], specs: list[TensorSpec]) -> PushSink: ...
    def open_pull(self, header: dict[str, Any]) -> PullSource: ...


def _streams_of(handler: Any) -> StreamHandler | None:
    owner = getattr(handler, "__self__", None)
    if owner is not None and hasattr(owner, "open_push") and hasattr(owner, "open_pull"):
        return owner
    return None


#: What a handler raises to refuse a request (the reply names it); anything else is a bug.
REFUSED = (ValueError, KeyError, Refused)


def _error(key: bytes, ident: bytes, exc: BaseException, xfer: bytes | None = None) -> list:
    """An error reply; ``code`` is the :class:`Refusal` the client decides on."""
    code = exc.code if isinstance(exc, Refused) else (
        Refusal.INVALID_ARGUMENT if isinstance(exc, (ValueError, KeyError)) else Refusal.UNSPECIFIED)
    head = {"op": "error", "error": str(exc), "code": int(code)}
    if xfer is not None:
        head["xfer"] = xfer.hex()
    return [ident, MSG, *encode(key, head)]


class _Xfer:
    def __init__(self, reader: StreamReader, sink: PushSink, key: bytes) -> None:
        self.reader, self.sink, self.key = reader, sink, key
        self.failed, self.seen = False, time.monotonic()


class DataServer:
    """A ROUTER socket served by three threads (see the module docstring).

    Args:
        keys: the members' keys (a request under an unknown or malformed key id is dropped).
        handler: ``Message -> (reply header, reply tensors)`` for single-message requests; a
            raised ``ValueError``/``KeyError`` (including :class:`FrameError`) becomes an
            ``{"op": "error"}`` reply naming it.
        host, port: where to bind (port 0 picks a free one, see :attr:`endpoint`).
        poll_s: seconds between checks of the stop flag.
        streams: serves push/pull streams; default: the object ``handler`` is a bound method
            of, if it has ``open_push`` and ``open_pull`` (e.g. a FollowerShard).
        ring_chunks: chunks (of at most :data:`~dips.wire.stream.MAX_CHUNK_BYTES`) received
            and not yet consumed, at most (the credits above).
        stale_s: a push stream idle this long is aborted (its sender died).
        authorize: ``(sender identity, header) -> None``, raising Refused(FORBIDDEN) to refuse
            a request (default: every member may do anything).

    Raises:
        ValueError: ``ring_chunks`` < 1. zmq.ZMQError: the address cannot be bound.
    """

    def __init__(self, keys: Keyring, handler: Handler, host: str = "127.0.0.1", port: int = 0,
                 poll_s: float = 0.1, *, streams: StreamHandler | None = None,
                 ring_chunks: int = 8, stale_s: float = 120.0,
                 authorize: Authorize = _allow_all) -> None:
        self._keys = keys
        self._authorize = authorize
        self._handler = handler
        self._streams = streams or _streams_of(handler)
        self._poll_s = poll_s
        self._stale_s = stale_s
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 32)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # outgoing chunks are zero-copy references
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            if port:
                self._sock.bind(f"tcp://{host}:{port}")
            else:
                port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError:
            self._sock.close(0)  # nothing left open behind a failed start
            raise
        self.endpoint = f"tcp://{host}:{port}"
        self.extra_endpoints: list[str] = []
        # A fresh name per server: libzmq releases an inproc name asynchronously after close,
        # so a name derived from id(self) could still be taken when a new server reuses the id.
        self._outbox_addr = f"inproc://dips-outbox-{os.getpid()}-{next(_OUTBOX_IDS)}"
        self._outbox = self._ctx.socket(zmq.PULL)
        self._outbox.setsockopt(zmq.LINGER, 0)
        self._outbox.bind(self._outbox_addr)
        if ring_chunks < 1:
            raise ValueError(f"ring_chunks = {ring_chunks} must be >= 1")
        # C-level queues (no Python-level Condition per chunk): one token per credit.
        self._credits: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(ring_chunks):
            self._credits.put(None)
        self._inq: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._scratch = memoryview(bytearray(MAX_CHUNK_BYTES))  # the consumer's decryptions
        self._pullq: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=f, name=n, daemon=True) for f, n in
                         ((self._serve, "data-io"), (self._consume, "data-consumer"),
                          (self._produce, "data-producer"))]

    def bind(self, endpoint: str) -> None:
        """Also accept requests on ``endpoint`` (e.g. ``ipc://PATH`` for a local reader that
        cannot reach the TCP address, such as a launcher outside the network namespace).
        Call before :meth:`start`."""
        self._sock.bind(endpoint)
        self.extra_endpoints.append(endpoint)

    def start(self) -> "DataServer":
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout_s)
        self._sock.close(0)
        self._outbox.close(0)

    # ----- data-io -------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._outbox, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(int(self._poll_s * 1000)))
            if self._outbox in events:
                self._forward()
            if self._sock in events:
                for _ in range(16):  # what is ready, then a look at the outbox again
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._receive(frames)

    def _forward(self) -> None:
        for _ in range(256):
            try:
                frames = self._outbox.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._sock.send_multipart(frames, copy=False)
            except zmq.ZMQError as exc:  # the peer is gone (EHOSTUNREACH): drop its reply
                log.debug("data-plane reply dropped: %s", exc)

    def _receive(self, frames: list[zmq.Frame]) -> None:
        # zero-copy: the frames own the buffers libzmq received the message into
        ident = frames[0].bytes
        kind = frames[1].bytes if len(frames) > 1 else b""
        if kind == CHUNK:
            while True:
                try:
                    self._credits.get(timeout=self._poll_s)
                    break
                except queue.Empty:
                    if self._stop.is_set():
                        return
            # [ident, C, meta, tag, data]; a malformed chunk fails its stream at the consumer
            if len(frames) == 5:
                self._inq.put((ident, CHUNK, frames[2].bytes, frames[3].bytes, frames[4]))
            else:
                self._inq.put((ident, CHUNK, frames[2].bytes if len(frames) > 2 else b"", b"",
                               None))
            return
        rest = [f.buffer for f in frames[2:]]
        if kind in (MSG, BEGIN, END):
            self._inq.put((ident, kind, rest))
        elif kind == PULL:
            self._pullq.put((ident, rest))
        else:
            log.warning("data-plane message of unknown kind %r dropped", kind[:8])

    # ----- data-consumer -------------------------------------------------------------
    def _consume(self) -> None:
        out = self._ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        out.connect(self._outbox_addr)
        xfers: dict[tuple[bytes, bytes], _Xfer] = {}
        try:
            while not self._stop.is_set():
                try:
                    item = self._inq.get(timeout=self._poll_s)
                except queue.Empty:
                    self._purge(xfers)
                    continue
                ident, kind = item[0], item[1]
                if kind == CHUNK:
                    self._chunk(out, xfers, *item)
                elif kind == BEGIN:
                    self._begin(out, xfers, ident, item[2])
                elif kind == END:
                    self._end(out, xfers, ident, item[2])
                else:
                    reply = self._single(ident, item[2])
                    if reply:
                        out.send_multipart(reply, copy=False)
        finally:
            for x in xfers.values():
                if not x.failed:
                    x.sink.abort("data server stopped")
            out.close(0)

    def _member(self, frames: list) -> MemberKey | None:
        """The sender's key from the key-id frame, or None (logged: the request is dropped,
        as nothing could authenticate a reply to it)."""
        try:
            if not frames:
                raise FrameError("request has no key id frame")
            return self._keys.get(bytes(frames[0]))
        except FrameError as exc:
            log.warning("data-plane request dropped: %s", exc)
            return None

    def _check_member(self, mk: MemberKey) -> None:
        """Refuse (NOT_JOINED) an authentic request under a key that is no longer a member's."""
        if not self._keys.current(mk.key_id):
            raise Refused(Refusal.NOT_JOINED, f"key {mk.key_id[:40]}... is no longer a "
                                              "member's: join again")

    def _single(self, ident: bytes, frames: list) -> list:
        mk = self._member(frames)
        if mk is None:
            return []
        try:
            msg = decode(mk.key, frames[1:], require_encrypted=mk.encrypt)
            self._check_member(mk)
            self._authorize(mk.identity, msg.header)
            header, tensors = self._handler(msg)
        except REFUSED as exc:
            log.warning("data-plane request refused: %s", exc)
            return _error(mk.key, ident, exc)
        except Exception as exc:  # keep serving other peers; report the failure
            log.exception("data-plane handler failed")
            return _error(mk.key, ident, RuntimeError(f"internal: {exc}"))
        return [ident, MSG, *encode(mk.key, header, tensors, encrypt=mk.encrypt)]

    def _fail(self, out: zmq.Socket, ident: bytes, x: _Xfer, exc: BaseException) -> None:
        log.warning("data-plane push refused: %s", exc)
        x.failed = True
        x.sink.abort(str(exc))
        out.send_multipart(_error(x.key, ident, exc, x.reader.xfer), copy=False)

    def _begin(self, out: zmq.Socket, xfers: dict, ident: bytes, frames: list) -> None:
        mk = self._member(frames)
        if mk is None:
            return
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
            sink = self._streams.open_push(reader.header, reader.specs)
        except REFUSED as exc:
            log.warning("data-plane push refused: %s", exc)
            out.send_multipart(_error(mk.key, ident, exc, reader and reader.xfer), copy=False)
            return
        xfers[(ident, reader.xfer)] = _Xfer(reader, sink, mk.key)

    def _chunk(self, out: zmq.Socket, xfers: dict, ident: bytes, _kind: bytes, meta: bytes,
               tag: bytes, frame: zmq.Frame | None) -> None:
        try:
            x = xfers.get((ident, meta[:16]))
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
            except REFUSED as exc:
                self._fail(out, ident, x, exc)
        finally:
            self._credits.put(None)

    def _end(self, out: zmq.Socket, xfers: dict, ident: bytes, frames: list) -> None:
        meta = bytes(frames[0]) if frames else b""
        x = xfers.pop((ident, meta[:16]), None)
        if x is None or x.failed:
            return
        try:
            if len(frames) != 2:
                raise FrameError(f"end message has {len(frames)} frames, expected 2")
            x.reader.end(meta, bytes(frames[1]))
            reply = x.sink.commit()
        except REFUSED as exc:
            self._fail(out, ident, x, exc)
            return
        out.send_multipart([ident, MSG, *encode(x.key, {**reply, "xfer": x.reader.xfer.hex()})],
                           copy=False)

    def _purge(self, xfers: dict) -> None:
        now = time.monotonic()
        for k in [k for k, x in xfers.items() if now - x.seen > self._stale_s]:
            x = xfers.pop(k)
            if not x.failed:
                x.sink.abort(f"stream idle for more than {self._stale_s} s")

    # ----- data-producer -------------------------------------------------------------
    def _produce(self) -> None:
        self._ring = SealRing()  # this thread's buffers for encrypted pull chunks
        out = self._ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        out.setsockopt(zmq.SNDHWM, 0)
        out.connect(self._outbox_addr)
        try:
            while not self._stop.is_set():
                try:
                    ident, frames = self._pullq.get(timeout=self._poll_s)
                except queue.Empty:
                    continue
                self._serve_pull(out, ident, frames)
        finally:
            out.close(0)

    def _serve_pull(self, out: zmq.Socket, ident: bytes, frames: list) -> None:
        mk = self._member(frames)
        if mk is None:
            return
        xfer = None
        try:
            msg = decode(mk.key, frames[1:])
            xfer = _xfer_id(msg.header.pop("xfer", None))
            chunk = check_chunk_bytes(msg.header.pop("chunk", None))
            self._check_member(mk)
            self._authorize(mk.identity, msg.header)
            if self._streams is None:
                raise ValueError("this data server does not serve streams")
            src = self._streams.open_pull(msg.header)
            writer = StreamWriter(mk.key, src.header, src.specs, chunk, xfer=xfer,
                                  encrypt=mk.encrypt, ring=self._ring)
            out.send_multipart([ident, *writer.begin()])
            for i in range(len(src.specs)):
                for parts in writer.chunks(i, src.tensor(i)):
                    tracker = out.send_multipart([ident, *parts], copy=False,
                                                 track=writer.encrypted)
                    if writer.encrypted:
                        self._ring.track(tracker)
            src.finish()
            out.send_multipart([ident, *writer.end()])
        except REFUSED as exc:
            log.warning("data-plane pull refused: %s", exc)
            out.send_multipart(_error(mk.key, ident, exc, xfer), copy=False)
        except Exception as exc:
            log.exception("data-plane pull failed")
            out.send_multipart(_error(mk.key, ident, RuntimeError(f"internal: {exc}"), xfer))


__all__ = ["DataClient", "DataPlaneError", "DataServer", "FrameError", "PullSource", "PushSink",
           "StreamHandler"]
