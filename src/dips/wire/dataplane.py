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
* ``data-producer`` serves pull streams (:class:`~dips.wire.pushstreams.PullStreams`): it
  asks the role for each tensor in turn (the follower converts the next layer to BF16 while
  libzmq sends the current one) and queues its chunks without copying them, each stream only
  a window ahead of what its connection took, many streams in turn.

Every request names its sender's key id in clear (``[kind, key id, ...]``); the server
derives that member's key (:class:`~dips.wire.keys.Keyring`), verifies the request with it,
answers with it, and asks ``authorize`` whether that member may do that (a follower lets a
cluster push only as itself). Keys are per member: no two members share one.

The client side is :class:`~dips.wire.dataclient.DataClient` (one DEALER socket).

Hostile input (issue 13): every message is handled on its own — whatever it raises is answered
with a typed refusal (``code``: a :class:`~dips.algo.refusal.Refusal`; an exception that is no
refusal is a bug, logged with its traceback once per kind and answered UNSPECIFIED) and the
threads go on serving. ``ZMQ_MAXMSGSIZE`` bounds each frame libzmq accepts to the largest
legitimate one (a chunk, a header, or the largest tensor of the follower's shard), so an
oversized message is dropped before anything is allocated for it. Should a thread die all
the same, :attr:`DataServer.error` says so and :attr:`DataServer.died` is set; the follower
reports it in its heartbeat and the leader marks it down.

Memory a member can make the server hold by not reading (issue 13) is bounded per member and
connection (:mod:`dips.wire.serving`): at most :data:`~dips.wire.serving.MAX_PULLS_PER_MEMBER`
pull streams in flight (one being produced holds its source: a reader of the version's
shared BF16 snapshot, or one FP32 tensor copy),
:data:`~dips.wire.serving.PULL_BYTES_PER_MEMBER` of pull messages handed to libzmq and not
yet written (plus one message), BUSY beyond; and
:data:`~dips.wire.serving.SEND_HWM` messages queued per connection, dropped beyond. A pull
stream that can send nothing for ``pull_stall_s`` is dropped. The kernel's socket buffers
(``net.ipv4.tcp_wmem``) come on top, per connection.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from typing import Callable

import zmq

from dips.algo.refusal import Refusal, Refused
from dips.wire.dataclient import MSG, PULL, DataClient, DataPlaneError
from dips.wire.frames import FrameError, decode, encode
from dips.wire.keys import Keyring, MemberKey
from dips.wire.pushstreams import PullStreams, PushStreams
from dips.wire.serving import (
    MAX_PULLS_PER_MEMBER,
    PULL_BYTES_PER_MEMBER,
    PULL_WINDOW_BYTES,
    REFUSED,
    SEND_HWM,
    Authorize,
    Handler,
    Incidents,
    PullLedger,
    PullSource,
    PushConnections,
    PushSink,
    StreamHandler,
    allow_all,
    error_reply,
    streams_of,
)
from dips.wire.stream import BEGIN, CHUNK, END

log = logging.getLogger(__name__)
_OUTBOX_IDS = itertools.count()
#: Seconds the producer waits for a stream's window to open before it looks for new requests.
_WAIT_S = 0.005


class DataServer:
    """A ROUTER socket served by three threads (see the module docstring).

    Args:
        keys: the members' keys (a request under an unknown or malformed key id is dropped).
        handler: ``Message -> (reply header, reply tensors)`` for single-message requests; a
            raised :class:`~dips.algo.refusal.Refused` or ``ValueError`` (including
            :class:`FrameError`, code INVALID_ARGUMENT) becomes an ``{"op": "error"}`` reply
            naming it; any other exception a reply with code UNSPECIFIED (and a log entry).
        host, port: where to bind (port 0 picks a free one, see :attr:`endpoint`).
        poll_s: seconds between checks of the stop flag.
        streams: serves push/pull streams; default: the object ``handler`` is a bound method
            of, if it has ``open_push`` and ``open_pull`` (e.g. a FollowerShard).
        ring_chunks: chunks (of at most :data:`~dips.wire.stream.MAX_CHUNK_BYTES`) received
            and not yet consumed, at most (the credits above).
        stale_s: a push stream idle this long is aborted (its sender died).
        authorize: ``(sender identity, header) -> None``, raising Refused(FORBIDDEN) to refuse
            a request (default: every member may do anything).
        max_message_bytes: the largest frame accepted (``ZMQ_MAXMSGSIZE``; bytes): libzmq
            drops the connection of a peer that sends a larger one before allocating it.
            Default: ``streams.max_message_bytes()`` when the stream handler has it (a
            follower computes it from its shard), else no limit.
        max_pulls, pull_bytes: a member's pull streams in flight, and bytes of its pulls
            not yet written, at most (:class:`~dips.wire.serving.PullLedger`; BUSY beyond).
        pull_stall_s: a pull stream that could send nothing this long (its peer does not
            read) is dropped; default ``stale_s``.
        pull_window_bytes: bytes of one pull stream handed to libzmq and not yet written, at
            most (:data:`~dips.wire.serving.PULL_WINDOW_BYTES`).

    Attributes:
        died: set when a serving thread died (see :attr:`error`).
        pulls: what members' pulls hold (:class:`~dips.wire.serving.PullLedger`).
        send_dropped: messages libzmq refused because their connection's queue was full
            (``SEND_HWM``: its peer does not read).

    Raises:
        ValueError: ``ring_chunks`` < 1. zmq.ZMQError: the address cannot be bound.
    """

    def __init__(self, keys: Keyring, handler: Handler, host: str = "127.0.0.1", port: int = 0,
                 poll_s: float = 0.1, *, streams: StreamHandler | None = None,
                 ring_chunks: int = 8, stale_s: float = 120.0,
                 authorize: Authorize = allow_all, max_message_bytes: int | None = None,
                 max_pulls: int = MAX_PULLS_PER_MEMBER, pull_bytes: int = PULL_BYTES_PER_MEMBER,
                 pull_stall_s: float | None = None,
                 pull_window_bytes: int = PULL_WINDOW_BYTES) -> None:
        if ring_chunks < 1:
            raise ValueError(f"ring_chunks = {ring_chunks} must be >= 1")
        self._keys = keys
        self._authorize = authorize
        self._handler = handler
        self._streams = streams or streams_of(handler)
        self._poll_s = poll_s
        self._stale_s = stale_s
        self._pull_stall_s = stale_s if pull_stall_s is None else pull_stall_s
        self._pull_window_bytes = pull_window_bytes
        self.pulls = PullLedger(max_pulls, pull_bytes)
        self._pull_streams: PullStreams | None = None
        self._push_streams: PushStreams | None = None
        self.send_dropped = 0
        # Bytes of every frame received and sent on the socket (counted by its one serving
        # thread; read without a lock: an int read is atomic).
        self.bytes_received = 0
        self.bytes_sent = 0
        if max_message_bytes is None and hasattr(self._streams, "max_message_bytes"):
            max_message_bytes = int(self._streams.max_message_bytes())
        self.max_message_bytes = max_message_bytes
        self._incident = Incidents()
        self._error: str | None = None
        self.died = threading.Event()
        self._push_conns = PushConnections()  # read with push_connections
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if max_message_bytes is not None:
            self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._sock.setsockopt(zmq.RCVHWM, 32)
        # Per connection; the chunks are zero-copy references, and pull streams are produced
        # only a window ahead (PullStreams), so only a peer that does not read reaches it.
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue refuses (EAGAIN)
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
        # C-level queues (no Python-level Condition per chunk): one token per credit.
        self._credits: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(ring_chunks):
            self._credits.put(None)
        self._inq: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._pullq: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(f, n), name=n, daemon=True)
                         for f, n in ((self._serve, "data-io"), (self._consume, "data-consumer"),
                                      (self._produce, "data-producer"))]
        self._started = False

    def push_connections(self, cluster: str, rnd: int) -> int:
        """How many distinct connections sent (accepted) push data of ``cluster`` for round
        ``rnd`` (:class:`~dips.wire.serving.PushConnections`)."""
        return self._push_conns.count(cluster, rnd)

    def bind(self, endpoint: str) -> None:
        """Also accept requests on ``endpoint`` (e.g. ``ipc://PATH`` for a local reader that
        cannot reach the TCP address, such as a launcher outside the network namespace).
        Call before :meth:`start`."""
        self._sock.bind(endpoint)
        self.extra_endpoints.append(endpoint)

    def start(self) -> "DataServer":
        self._started = True
        for t in self._threads:
            t.start()
        return self

    def _run(self, body: Callable[[], None], name: str) -> None:
        """A serving thread: should it end before :meth:`stop` (a bug no per-message guard
        caught), say so instead of serving nothing in silence."""
        try:
            body()
        except BaseException as exc:
            if not self._stop.is_set():
                self._error = f"thread {name} died: {type(exc).__name__}: {str(exc)[:200]}"
                log.critical("data plane stopped serving: %s", self._error, exc_info=exc)
        finally:
            if not self._stop.is_set():
                self._error = self._error or f"thread {name} ended"
                self.died.set()

    @property
    def error(self) -> str | None:
        """Why the data plane stopped serving (a thread died), or None while it serves."""
        if self._error is None and self._started and not self._stop.is_set():
            for t in self._threads:
                if not t.is_alive():
                    return f"thread {t.name} is not running"
        return self._error

    def healthy(self) -> bool:
        """Whether every serving thread runs (always False before :meth:`start`)."""
        return self._started and self.error is None

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
                    self.bytes_received += sum(len(f) for f in frames)
                    try:
                        self._receive(frames)
                    except Exception as exc:  # the message is dropped; the socket serves on
                        self._incident("receive", exc)

    def _forward(self) -> None:
        # Never blocks: a message for a connection whose queue is full (SEND_HWM: its peer
        # does not read) or that is gone (EHOSTUNREACH) is dropped. No frame is kept here
        # after its send, so libzmq alone holds it and its tracker says when it is written.
        for _ in range(256):
            try:
                frames = self._outbox.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                self.bytes_sent += sum(len(f) for f in frames)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EAGAIN:
                    self.send_dropped += 1
                log.debug("data-plane message dropped: %s", exc)
            del frames

    def _receive(self, frames: list[zmq.Frame]) -> None:
        # zero-copy: the frames own the buffers libzmq received the message into
        ident = frames[0].bytes
        kind = frames[1].bytes if len(frames) > 1 else b""
        if kind == CHUNK:
            # [ident, C, meta, tag, data]; a malformed chunk fails its stream at the consumer.
            # Only 20 bytes of meta and 16 of tag matter: longer frames are cut, not copied.
            meta = frames[2].buffer[:64].tobytes() if len(frames) > 2 else b""
            item = ((ident, CHUNK, meta, frames[3].buffer[:64].tobytes(), frames[4])
                    if len(frames) == 5 else (ident, CHUNK, meta, b"", None))
            while True:  # a credit per chunk held: the consumer gives it back
                try:
                    self._credits.get(timeout=self._poll_s)
                    break
                except queue.Empty:
                    if self._stop.is_set():
                        return
            self._inq.put(item)
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
        pushes = PushStreams(self._streams, self._authorize, self._check_member, self._incident,
                             self._stale_s)
        pushes.seen = self._push_conns.note
        self._push_streams = pushes
        purge_at = 0.0
        try:
            while not self._stop.is_set():
                try:
                    item = self._inq.get(timeout=self._poll_s)
                except queue.Empty:
                    item = None
                if item is not None:
                    try:
                        self._dispatch(out, pushes, item)
                    except Exception as exc:  # each handler answers its own refusals; a bug
                        self._incident("consumer", exc)  # here loses this message, not the thread
                now = time.monotonic()
                if now >= purge_at:  # also under a steady flow of messages
                    purge_at = now + self._poll_s
                    try:
                        pushes.purge(out)
                    except Exception as exc:
                        self._incident("purge", exc)
        finally:
            pushes.close()
            out.close(0)

    def _dispatch(self, out: zmq.Socket, pushes: PushStreams, item: tuple) -> None:
        ident, kind = item[0], item[1]
        if kind == CHUNK:
            try:
                pushes.chunk(out, ident, *item[2:])
            finally:
                self._credits.put(None)
            return
        if kind == END:  # [meta, mac]: the stream's key was found at its BEGIN
            pushes.end(out, ident, item[2])
            return
        mk = self._member(item[2])
        if mk is None:
            return
        if kind == BEGIN:
            pushes.begin(out, ident, mk, item[2])
        else:
            self._single(out, ident, mk, item[2])

    def _member(self, frames: list) -> MemberKey | None:
        """The sender's key from the key-id frame, or None (logged: the request is dropped,
        as nothing could authenticate a reply to it)."""
        try:
            if not frames:
                raise FrameError("request has no key id frame")
            return self._keys.get(bytes(frames[0][:256]))
        except FrameError as exc:
            log.warning("data-plane request dropped: %s", exc)
            return None

    def _check_member(self, mk: MemberKey) -> None:
        """Refuse (NOT_JOINED) an authentic request under a key that is no longer a member's."""
        if not self._keys.current(mk.key_id):
            raise Refused(Refusal.NOT_JOINED, f"key {mk.key_id[:40]}... is no longer a "
                                              "member's: join again")

    def _single(self, out: zmq.Socket, ident: bytes, mk: MemberKey, frames: list) -> None:
        """Answer one single message. A pull is admitted by its member's pull budget
        (:class:`~dips.wire.serving.PullLedger`, BUSY beyond) and its reply counted against
        it until libzmq wrote it."""
        pull = False
        try:
            msg = decode(mk.key, frames[1:], require_encrypted=mk.encrypt)
            self._check_member(mk)
            self._authorize(mk.identity, msg.header)
            if msg.header.get("op") == "pull":
                self.pulls.admit(mk.identity.name, stream=False)
                pull = True
            header, tensors = self._handler(msg)
            if msg.header.get("op") == "push":
                self._push_conns.note(ident, msg.header)
            reply = [ident, MSG, *encode(mk.key, header, tensors, encrypt=mk.encrypt)]
        except REFUSED as exc:
            pull = False
            if isinstance(exc, Refused) and exc.code is Refusal.BUSY:
                log.debug("data-plane request refused: %s", exc)
            else:
                log.warning("data-plane request refused: %s", exc)
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
        self.pulls.handed(mk.identity.name, nbytes)
        self.pulls.finish(mk.identity.name, deque([(tracker, nbytes)]), stream=False)

    # ----- data-producer -------------------------------------------------------------
    def _produce(self) -> None:
        out = self._ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        out.setsockopt(zmq.SNDHWM, SEND_HWM)  # streams are windowed: this only paces a burst
        out.connect(self._outbox_addr)
        pulls = PullStreams(self._streams, self._authorize, self._check_member, self._incident,
                            self.pulls, self._pull_stall_s, self._pull_window_bytes)
        self._pull_streams = pulls
        try:
            while not self._stop.is_set():
                first = None
                if not pulls.active:  # nothing to send: wait for a request
                    try:
                        first = self._pullq.get(timeout=self._poll_s)
                    except queue.Empty:
                        pulls.release_written()
                        continue
                self._intake(out, pulls, first)
                try:
                    moved = pulls.pump(out)
                except Exception as exc:  # each stream answers its own failure; a bug here
                    self._incident("producer", exc)
                    moved = True
                if not moved and pulls.active and not pulls.wait(_WAIT_S):
                    try:  # every stream waits for its member's budget: look for requests
                        self._intake(out, pulls, self._pullq.get(timeout=_WAIT_S))
                    except queue.Empty:
                        pass
        finally:
            pulls.close()
            out.close(0)

    def _intake(self, out: zmq.Socket, pulls: PullStreams, first: tuple | None) -> None:
        """Answer the pull requests waiting (up to 64, ``first`` the first of them): each
        stream begins, or is refused, at once."""
        item = first
        for _ in range(64):
            if item is None:
                try:
                    item = self._pullq.get_nowait()
                except queue.Empty:
                    return
            ident, frames = item
            item = None
            mk = self._member(frames)
            if mk is None:
                continue
            try:
                pulls.open(out, ident, mk, frames)
            except Exception as exc:  # refusals are answered inside; this is a bug
                self._incident("producer", exc)

    def pull_stats(self) -> dict[str, int]:
        """What pulls hold now: ``streams`` in flight and ``held_bytes`` not yet written
        (every member), ``producing`` streams and their ``queued_bytes``, ``refused`` (BUSY)
        and ``dropped`` (stalled) pulls, ``send_dropped`` messages, ``sealed_buffers``
        allocated for encrypted chunks, ``push_streams`` open; ``bytes_received`` and
        ``bytes_sent`` on the socket since the start (every frame, headers included)."""
        pulls, pushes = self._pull_streams, self._push_streams
        return {"streams": self.pulls.streams(), "held_bytes": self.pulls.held(),
                "producing": pulls.active if pulls else 0,
                "queued_bytes": pulls.queued() if pulls else 0,
                "refused": self.pulls.refused, "dropped": pulls.dropped if pulls else 0,
                "send_dropped": self.send_dropped,
                "sealed_buffers": pulls.ring.allocated if pulls else 0,
                "push_streams": pushes.open if pushes else 0,
                "bytes_received": self.bytes_received, "bytes_sent": self.bytes_sent}


__all__ = ["DataClient", "DataPlaneError", "DataServer", "FrameError", "PullSource", "PushSink",
           "StreamHandler"]
