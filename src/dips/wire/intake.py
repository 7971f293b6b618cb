"""What a data server's io thread lets in, and how its two workers take turns (issue 13,
review 21 F1): whole messages bounded by what their kind carries, queues bounded per
connection and in all, and work taken round-robin per connection.

libzmq's ``ZMQ_MAXMSGSIZE`` bounds each *frame*; a multipart message may have any number of
them. So before a message is queued its frame count and the sum of its frame sizes are
checked against :class:`MessageLimits` (derived from the shard: its largest layer, chunk and
header), and one beyond them is dropped at once. libzmq itself still assembles a whole
multipart message before it delivers any frame of it (one per connection in progress, and
``RCVHWM`` complete ones): only authenticated connections, or the network edge, bound that.

:class:`FairQueue` holds what the io thread passed on for one worker (the consumer: pushes and
single messages; the producer: pull requests): a FIFO per connection, so a stream stays in
order, served round-robin, so one connection's backlog waits behind itself only. Messages of
a connection beyond ``max_messages`` or ``max_bytes`` are refused at once (never buffered);
beyond ``total_bytes`` over all connections, the newest message of the fullest connection is
dropped to make room for a connection holding less (or the new one is refused, if it is the
fullest). Items put with ``force`` (chunks, bounded by the server's credits instead) are
never refused and count towards neither byte bound.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Hashable

from dips.wire.frames import MAX_HEADER_BYTES
from dips.wire.seal import TAG_BYTES
from dips.wire.stream import MAX_CHUNK_BYTES

#: Bytes of a request's frames other than its header and payloads: key id (at most 256 read),
#: MAC, kind, and the stream meta of chunks and ends.
ENVELOPE_BYTES = 1024
#: What a data server without a shard accepts in one single message by default.
DEFAULT_SINGLE_BYTES = 64 << 20
DEFAULT_SINGLE_FRAMES = 1024


@dataclass(frozen=True)
class MessageLimits:
    """The most one message of each kind may carry (bytes; frames after the kind frame).

    Attributes:
        frame_bytes: the largest frame (libzmq's ``ZMQ_MAXMSGSIZE``), None: no limit.
        header_bytes: the largest request header (of a pull, a stream BEGIN, a single message).
        single_bytes: a single message (``M``) in all: a header and one layer's tensors.
        single_frames: payload frames of a single message (the most tensors of one layer).
    """

    frame_bytes: int | None = None
    header_bytes: int = MAX_HEADER_BYTES
    single_bytes: int = DEFAULT_SINGLE_BYTES
    single_frames: int = DEFAULT_SINGLE_FRAMES

    def check(self, kind: bytes, frames: int, nbytes: int) -> str | None:
        """Why a message of ``kind`` with ``frames`` frames after its kind frame (key id,
        header, ...) and ``nbytes`` bytes in all is refused (a reason of
        :data:`dips.wire.refusals.REASONS`), or None. Kinds: ``M``, ``B``, ``C``, ``E``, ``R``."""
        most_frames, most_bytes = self.most(kind)
        if frames > most_frames:
            return "too_many_frames"
        if nbytes > most_bytes:
            return "too_large"
        return None

    def most(self, kind: bytes) -> tuple[int, int]:
        """``(frames, bytes)`` a message of ``kind`` carries at most (frames after its kind)."""
        if kind == b"C":  # meta, tag, data
            return 3, MAX_CHUNK_BYTES + TAG_BYTES + ENVELOPE_BYTES
        if kind == b"E":  # meta, mac
            return 2, ENVELOPE_BYTES
        if kind in (b"B", b"R"):  # key id, header, mac
            return 3, self.header_bytes + ENVELOPE_BYTES
        if kind == b"M":  # key id, header, mac, payloads
            return 3 + self.single_frames, self.single_bytes + ENVELOPE_BYTES
        return 0, 0


def shard_limits(tensors: dict[str, tuple[int, ...]], layers: dict[str, list[str]],
                 frame_bytes: int) -> MessageLimits:
    """The limits of a follower serving ``layers`` (layer -> tensor names) of ``tensors``
    (name -> shape): a single message carries one layer in FP32 (each payload with its GCM
    tag) and a header, a header names at most every tensor and layer of the shard (with a
    ticket and the stream fields: 8 KiB), a frame at most ``frame_bytes``."""
    def fp32(name: str) -> int:
        n = 4
        for d in tensors[name]:
            n *= d
        return n + TAG_BYTES

    names = [n for ns in layers.values() for n in ns]
    header = min(MAX_HEADER_BYTES, 8192 + sum(len(n) + 128 for n in names)
                 + sum(len(l) + 8 for l in layers))
    layer_bytes = max((sum(fp32(n) for n in ns) for ns in layers.values()), default=0)
    return MessageLimits(frame_bytes, header, layer_bytes + header,
                         max((len(ns) for ns in layers.values()), default=0))


class FairQueue:
    """Per-connection FIFO queues served round-robin (thread-safe; see the module docstring).

    Args:
        max_messages: messages queued per connection (not counting forced ones), at most.
        max_bytes: bytes queued per connection (not forced), at most; a message larger than
            this is still taken when its connection has nothing queued (its kind's limit
            bounds it).
        total_bytes: bytes queued over every connection (not forced), at most.
        on_drop: called with each item dropped to make room (so its owner can undo what
            queueing it meant), outside the lock.
        clock: monotonic seconds.

    Attributes:
        refused, evicted: messages refused at :meth:`put`, and dropped to make room.
    """

    def __init__(self, max_messages: int, max_bytes: int, total_bytes: int,
                 on_drop: Callable[[Any], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if min(max_messages, max_bytes, total_bytes) < 1:
            raise ValueError(f"max_messages = {max_messages}, max_bytes = {max_bytes}, "
                             f"total_bytes = {total_bytes} must be >= 1")
        self.max_messages, self.max_bytes, self.total_bytes = max_messages, max_bytes, total_bytes
        self._on_drop = on_drop
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._queues: dict[Hashable, deque] = {}  # conn -> [(item, nbytes, forced)]
        self._counted: dict[Hashable, list[int]] = {}  # conn -> [messages, bytes] not forced
        self._since: dict[Hashable, float] = {}  # conn -> when it last became next in turn
        self._ready: deque = deque()  # connections with items, in turn order
        self._bytes = 0
        self._len = 0
        self.refused = self.evicted = 0

    def put(self, conn: Hashable, item: Any, nbytes: int, force: bool = False) -> str | None:
        """Queue ``item`` (``nbytes`` bytes) of connection ``conn``; returns None, or why it
        was refused (``queue_full``: nothing was queued)."""
        dropped: list[Any] = []
        with self._cond:
            counted = self._counted.setdefault(conn, [0, 0])
            if not force:
                if counted[0] >= self.max_messages or (
                        counted[1] and counted[1] + nbytes > self.max_bytes):
                    self.refused += 1
                    self._tidy(conn)
                    return "queue_full"
                while self._bytes + nbytes > self.total_bytes and self._bytes:
                    fattest = max(self._counted, key=lambda c: self._counted[c][1])
                    if fattest == conn or self._counted[fattest][1] <= counted[1] + nbytes:
                        self.refused += 1
                        self._tidy(conn)
                        return "queue_full"
                    dropped.append(self._drop_newest(fattest))
                counted[0] += 1
                counted[1] += nbytes
                self._bytes += nbytes
            q = self._queues.get(conn)
            if q is None:
                q = self._queues[conn] = deque()
            if not q:
                self._ready.append(conn)
                self._since[conn] = self._clock()
            q.append((item, nbytes, force))
            self._len += 1
            self._cond.notify()
        for item in dropped:
            if self._on_drop is not None:
                self._on_drop(item)
        return None

    def _drop_newest(self, conn: Hashable) -> Any:
        """Remove the newest counted item of ``conn`` (lock held); returns it."""
        q = self._queues[conn]
        for k in range(len(q) - 1, -1, -1):
            item, nbytes, forced = q[k]
            if not forced:
                del q[k]
                self._uncount(conn, nbytes)
                self._len -= 1
                self.evicted += 1
                if not q:
                    self._ready.remove(conn)
                    self._since.pop(conn, None)
                    self._tidy(conn)
                return item
        raise AssertionError("a connection holding bytes has no counted item")

    def _uncount(self, conn: Hashable, nbytes: int) -> None:
        counted = self._counted[conn]
        counted[0] -= 1
        counted[1] -= nbytes
        self._bytes -= nbytes

    def _tidy(self, conn: Hashable) -> None:
        if not self._queues.get(conn):
            self._queues.pop(conn, None)
            if self._counted.get(conn) == [0, 0]:
                del self._counted[conn]

    def get(self, timeout_s: float) -> tuple[Hashable, Any] | None:
        """``(connection, item)``: the next connection in turn and its oldest item, waiting up
        to ``timeout_s`` seconds (0: not at all); None if nothing came."""
        with self._cond:
            if not self._ready and timeout_s > 0:
                self._cond.wait(timeout_s)
            if not self._ready:
                return None
            conn = self._ready.popleft()
            q = self._queues[conn]
            item, nbytes, forced = q.popleft()
            self._len -= 1
            if not forced:
                self._uncount(conn, nbytes)
            if q:
                self._ready.append(conn)  # its next item waits for its next turn
                self._since[conn] = self._clock()
            else:
                self._since.pop(conn, None)
                self._tidy(conn)
            return conn, item

    def __len__(self) -> int:
        return self._len

    def queued_bytes(self) -> int:
        """Bytes queued over every connection (forced items not counted)."""
        return self._bytes

    def queued(self, conn: Hashable) -> tuple[int, int]:
        """``(messages, bytes)`` of ``conn`` queued (forced items not counted)."""
        with self._cond:
            counted = self._counted.get(conn)
            return (counted[0], counted[1]) if counted else (0, 0)

    def connections(self) -> int:
        """Connections with something queued."""
        return len(self._ready)

    def wait_s(self) -> float:
        """Seconds the connection that waits longest for its turn has waited (0: none waits).
        Under round-robin one connection's backlog does not count against another's: this
        grows only when the worker stops taking items."""
        with self._cond:
            if not self._since:
                return 0.0
            return max(0.0, self._clock() - min(self._since.values()))


__all__ = ["DEFAULT_SINGLE_BYTES", "DEFAULT_SINGLE_FRAMES", "ENVELOPE_BYTES", "FairQueue",
           "MessageLimits", "shard_limits"]
