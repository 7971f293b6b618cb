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
* ``data-producer`` serves pull streams (:class:`~dips.wire.pullstreams.PullStreams`): it
  asks the role for each tensor in turn (the follower converts the next layer to BF16 while
  libzmq sends the current one) and queues its chunks without copying them, each stream only
  a window ahead of what its connection took, many streams in turn.

Every request names its sender's key id in clear (``[kind, key id, ...]``); the server
looks up that member's key (:class:`~dips.wire.keys.Keyring`), verifies the request with it,
answers with it, and asks ``authorize`` whether that member may do that (a follower lets a
cluster push only as itself). Keys are per member: no two members share one.

The client side is :class:`~dips.wire.dataclient.DataClient` (one DEALER socket).

Hostile input (issue 13; review 21, F1): the io thread screens every message before it is
queued, at the cost of a dictionary look-up: a kind it does not know, a key id that is no
current member's (:meth:`~dips.wire.keys.Keyring.lookup`: no MAC, no key derivation, no
reply), more frames or bytes than its kind carries on this shard (:mod:`dips.wire.intake`:
``ZMQ_MAXMSGSIZE`` bounds each frame only), a chunk or end on a connection with no push
stream, or a message its connection's queue has no room for, is dropped and counted by reason
(:mod:`dips.wire.refusals`: one log line per interval at most). The consumer and the producer
take work round-robin per connection (:class:`~dips.wire.intake.FairQueue`), so one peer's
backlog waits behind itself. Every message that gets through is handled on its own: whatever
it raises is answered with a typed refusal (``code``: a :class:`~dips.algo.refusal.Refusal`;
an exception that is no refusal is a bug, logged with its traceback once per kind and
answered UNSPECIFIED) and the threads go on serving. Should a thread die all the same,
:attr:`DataServer.error` says so and :attr:`DataServer.died` is set; should a connection wait
longer than ``starved_s`` for its turn, :meth:`DataServer.health` says so: the follower reports
either in its heartbeat and the leader marks it down.

Memory a member can make the server hold by not reading (issue 13) is bounded per member and
connection (:mod:`dips.wire.serving`): at most :data:`~dips.wire.serving.MAX_PULLS_PER_MEMBER`
pull streams in flight (one being produced holds its source: a reader of the version's
shared BF16 snapshot, or one FP32 tensor copy),
:data:`~dips.wire.serving.PULL_BYTES_PER_MEMBER` of pull messages handed to libzmq and not
yet written (plus one message, itself at most that), BUSY beyond; and
:data:`~dips.wire.serving.SEND_HWM` messages queued per connection, dropped beyond. A pull
stream that can send nothing for ``pull_stall_s`` is dropped. The kernel's socket buffers
(``net.ipv4.tcp_wmem``) come on top, per connection.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from typing import Callable

import zmq

from dips.algo.refusal import Refusal, Refused
from dips.wire.dataclient import DataClient, DataPlaneError
from dips.wire.frames import FrameError
from dips.wire.gate import Gate
from dips.wire.intake import MessageLimits
from dips.wire.keys import Keyring, MemberKey
from dips.wire.pullstreams import PullStreams
from dips.wire.pushstreams import PushStreams
from dips.wire.refusals import Incidents, Refusals
from dips.wire.serving import (
    MAX_PULLS_PER_MEMBER,
    PULL_BYTES_PER_MEMBER,
    PULL_WINDOW_BYTES,
    SEND_HWM,
    Authorize,
    Handler,
    PullLedger,
    PullSource,
    PushConnections,
    PushSink,
    StreamHandler,
    allow_all,
    streams_of,
)
from dips.wire.workers import BusyTime, SingleMessages, consume, produce

log = logging.getLogger(__name__)
_OUTBOX_IDS = itertools.count()
#: Seconds a connection may wait for its turn before the server reports itself starved.
STARVED_S = 30.0


class DataServer:
    """A ROUTER socket served by three threads (see the module docstring).

    Args:
        keys: the members' keys (a request under a key id :meth:`Keyring.lookup` does not
            find is dropped).
        handler: ``Message -> (reply header, reply tensors)`` for single-message requests; a
            raised :class:`~dips.algo.refusal.Refused` or ``ValueError`` (including
            :class:`FrameError`, code INVALID_ARGUMENT) becomes an ``{"op": "error"}`` reply
            naming it; any other exception a reply with code UNSPECIFIED (and a log entry).
        host, port: where to bind (port 0 picks a free one, see :attr:`endpoint`).
        poll_s: seconds between checks of the stop flag.
        streams: serves push/pull streams; default: the object ``handler`` is a bound method
            of, if it has ``open_push`` and ``open_pull`` (e.g. a FollowerShard).
        ring_chunks: chunks (of at most :data:`~dips.wire.stream.MAX_CHUNK_BYTES`) received
            and not yet consumed, at most (the credits; queues: :class:`~dips.wire.gate.Gate`).
        stale_s: a push stream idle this long is aborted (its sender died).
        authorize: ``(sender identity, header) -> None``, raising Refused(FORBIDDEN) to refuse
            a request (default: every member may do anything).
        max_message_bytes: the largest frame accepted (``ZMQ_MAXMSGSIZE``; bytes): libzmq
            drops the connection of a peer that sends a larger one before allocating it.
            Default: ``limits.frame_bytes``, else ``streams.max_message_bytes()`` when the
            stream handler has it (a follower computes it from its shard), else no limit.
        limits: what one message of each kind carries at most (frames, bytes in all;
            :class:`~dips.wire.intake.MessageLimits`); default ``streams.message_limits()``
            when the stream handler has it, else the defaults with ``max_message_bytes``.
        max_pulls, pull_bytes: a member's pull streams in flight, and bytes of its pulls
            not yet written, at most (:class:`~dips.wire.serving.PullLedger`; BUSY beyond).
        pull_stall_s: a pull stream that could send nothing this long (its peer does not
            read) is dropped; default ``stale_s``.
        pull_window_bytes: bytes of one pull stream handed to libzmq and not yet written, at
            most (:data:`~dips.wire.serving.PULL_WINDOW_BYTES`).
        starved_s: seconds a connection may wait for its turn at the consumer or producer
            before :meth:`health` reports the server starved.

    Attributes:
        died: set when a serving thread died (see :attr:`error`).
        pulls: what members' pulls hold (:class:`~dips.wire.serving.PullLedger`).
        refusals: what was refused, by reason (:class:`~dips.wire.refusals.Refusals`).
        limits: the :class:`~dips.wire.intake.MessageLimits` in force.
        send_dropped: messages libzmq refused because their connection's queue was full
            (``SEND_HWM``: its peer does not read).

    Raises:
        ValueError: ``ring_chunks`` < 1. zmq.ZMQError: the address cannot be bound.
    """

    def __init__(self, keys: Keyring, handler: Handler, host: str = "127.0.0.1", port: int = 0,
                 poll_s: float = 0.1, *, streams: StreamHandler | None = None,
                 ring_chunks: int = 8, stale_s: float = 120.0,
                 authorize: Authorize = allow_all, max_message_bytes: int | None = None,
                 limits: MessageLimits | None = None,
                 max_pulls: int = MAX_PULLS_PER_MEMBER, pull_bytes: int = PULL_BYTES_PER_MEMBER,
                 pull_stall_s: float | None = None,
                 pull_window_bytes: int = PULL_WINDOW_BYTES, starved_s: float = STARVED_S) -> None:
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
        self._starved_s = starved_s
        self.pulls = PullLedger(max_pulls, pull_bytes)
        self.send_dropped = 0
        # Bytes of every frame received and sent on the socket (counted by its one serving
        # thread; read without a lock: an int read is atomic).
        self.bytes_received = 0
        self.bytes_sent = 0
        if limits is None and hasattr(self._streams, "message_limits"):
            limits = self._streams.message_limits()
        if max_message_bytes is None:
            max_message_bytes = limits.frame_bytes if limits is not None else None
        if max_message_bytes is None and hasattr(self._streams, "max_message_bytes"):
            max_message_bytes = int(self._streams.max_message_bytes())
        self.limits = limits or MessageLimits(max_message_bytes)
        self.max_message_bytes = max_message_bytes
        self.refusals = Refusals()
        self._incident = Incidents(self.refusals)
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
        self._push_streams = PushStreams(self._streams, authorize, self._check_member,
                                         self._incident, stale_s)
        self._push_streams.seen = self._push_conns.note
        self._pull_streams = PullStreams(self._streams, authorize, self._check_member,
                                         self._incident, self.pulls, self._pull_stall_s,
                                         pull_window_bytes)
        self._gate = Gate(keys, self.limits, self.refusals, ring_chunks,
                          self._push_streams.open_on, self._send)
        self._inq, self._pullq = self._gate.inq, self._gate.pullq
        single = SingleMessages(handler, authorize, self._check_member, self._incident,
                                self.pulls, self._push_conns)
        self._stop = threading.Event()
        #: the consumer's and producer's busy seconds (``push``, ``pull``; the follower adds
        #: ``update``), taken into each applied record (:class:`dips.wire.workers.BusyTime`)
        self.busy = BusyTime()
        work = {"data-io": (self._serve, ()),
                "data-consumer": (consume, (self._ctx, self._outbox_addr, self._gate,
                                            self._push_streams, single, self._incident,
                                            self._stop, poll_s, self.busy)),
                "data-producer": (produce, (self._ctx, self._outbox_addr, self._gate,
                                            self._pull_streams, self._incident, self._stop,
                                            poll_s, self.busy))}
        self._threads = [threading.Thread(target=self._run, args=(f, a, n), name=n, daemon=True)
                         for n, (f, a) in work.items()]
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

    def _run(self, body: Callable[..., None], args: tuple, name: str) -> None:
        """A serving thread: should it end before :meth:`stop` (a bug no per-message guard
        caught), say so instead of serving nothing in silence."""
        try:
            body(*args)
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

    def waits(self) -> dict[str, float]:
        """Seconds the connection waiting longest for its turn has waited, at the consumer
        (pushes, single messages) and at the producer (pull requests); 0: none waits."""
        return {"data-consumer": self._inq.wait_s(), "data-producer": self._pullq.wait_s()}

    def health(self) -> str | None:
        """Why the data plane does not serve as it should, or None: a thread died
        (:attr:`error`), or a connection has waited more than ``starved_s`` seconds for its
        turn (the thread lives, but serves nothing: stuck, or starved). What the follower
        reports in its heartbeat (``data_plane_error``)."""
        if self.error is not None:
            return self.error
        for name, wait in self.waits().items():
            if wait > self._starved_s:
                return (f"{name} starved: a connection has waited {wait:.0f} s for its turn "
                        f"(at most {self._starved_s:.0f} s)")
        return None

    def healthy(self) -> bool:
        """Whether every serving thread runs and none is starved (False before :meth:`start`)."""
        return self._started and self.health() is None

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
                    nbytes = sum(len(f) for f in frames)
                    self.bytes_received += nbytes
                    try:  # screened and queued, or dropped (dips.wire.gate)
                        self._gate.receive(frames, nbytes - len(frames[0]), self._stop,
                                           self._poll_s)
                    except Exception as exc:  # the message is dropped; the socket serves on
                        self._incident("receive", exc)
                    del frames

    def _forward(self) -> None:
        # Never blocks: a message for a connection whose queue is full (SEND_HWM: its peer
        # does not read) or that is gone (EHOSTUNREACH) is dropped. No frame is kept here
        # after its send, so libzmq alone holds it and its tracker says when it is written.
        for _ in range(256):
            try:
                frames = self._outbox.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._send(frames)
            del frames

    def _send(self, frames: list) -> None:
        """Send ``frames`` on the socket (io thread only); never blocks: dropped if its
        connection's queue is full or it is gone."""
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            self.bytes_sent += sum(memoryview(f).nbytes for f in frames)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EAGAIN:
                self.send_dropped += 1
            log.debug("data-plane message dropped: %s", exc)

    def _check_member(self, mk: MemberKey) -> None:
        """Refuse (NOT_JOINED) an authentic request under a key that is no longer a member's."""
        if not self._keys.current(mk.key_id):
            raise Refused(Refusal.NOT_JOINED, f"key {mk.key_id[:40]}... is no longer a "
                                              "member's: join again")

    def pull_stats(self) -> dict[str, int]:
        """What pulls hold now: ``streams`` in flight and ``held_bytes`` not yet written
        (every member), ``producing`` streams and their ``queued_bytes``, ``refused`` (BUSY)
        and ``dropped`` (stalled) pulls, ``send_dropped`` messages, ``sealed_buffers``
        allocated for encrypted chunks, ``push_streams`` open; ``bytes_received`` and
        ``bytes_sent`` on the socket since the start (every frame, headers included);
        ``inq_messages`` and ``inq_bytes`` queued for the consumer (chunks counted in
        messages only), ``pullq_messages`` and ``pullq_bytes`` for the producer."""
        pulls, pushes = self._pull_streams, self._push_streams
        return {"streams": self.pulls.streams(), "held_bytes": self.pulls.held(),
                "producing": pulls.active, "queued_bytes": pulls.queued(),
                "refused": self.pulls.refused, "dropped": pulls.dropped,
                "send_dropped": self.send_dropped, "sealed_buffers": pulls.ring.allocated,
                "push_streams": pushes.open,
                "bytes_received": self.bytes_received, "bytes_sent": self.bytes_sent,
                "inq_messages": len(self._inq), "inq_bytes": self._inq.queued_bytes(),
                "pullq_messages": len(self._pullq), "pullq_bytes": self._pullq.queued_bytes()}

__all__ = ["DataClient", "DataPlaneError", "DataServer", "FrameError", "PullSource", "PushSink",
           "StreamHandler"]
