"""The io thread's gate of a data server (:mod:`dips.wire.dataplane`; issue 13, review 21 F1):
what it lets into the consumer's and the producer's queues, at the cost of a dictionary
look-up per message, and what it drops and counts.

In order, a message is dropped (counted by reason in :class:`~dips.wire.refusals.Refusals`,
never answered, never logged one line each) when: its kind is none of the data plane's
(``unknown_kind``); it has more frames or bytes than its kind carries on this shard
(:class:`~dips.wire.intake.MessageLimits`: ``too_many_frames``, ``too_large``); it is a
chunk or end on a connection with no push stream open or announced (``unknown_stream``); it
has no key id frame (``malformed``) or one :meth:`~dips.wire.keys.Keyring.lookup` does not
find (``key_id``, ``no_secret``, ``unknown_key``: no MAC is computed, no key derived beyond a
look-up); or its connection's queue has no room (``queue_full``, or ``evicted`` later to make
room for a connection holding less). A request under a member's key id with more frames or
bytes than its kind carries is answered INVALID_ARGUMENT (one small reply, not
authenticated against the request: the MAC of a message refused for its size is never
computed); the same without a member's key id, or a chunk or end, is dropped. A chunk waits for one of a fixed number of credits
instead (back-pressure: libzmq stops reading at ``RCVHWM``, then TCP's window closes).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

import zmq

from dips.algo.refusal import Refusal, Refused
from dips.wire.dataclient import MSG, PULL
from dips.wire.intake import ENVELOPE_BYTES, FairQueue, MessageLimits
from dips.wire.keys import Keyring
from dips.wire.refusals import Refusals
from dips.wire.serving import MAX_OPEN_STREAMS, MAX_PULLS_PER_MEMBER, error_reply
from dips.wire.stream import BEGIN, CHUNK, END

#: Messages (not chunks) one connection may have queued for the consumer, and pull requests
#: for the producer: an honest stage worker has one request and ``depth`` streams in flight
#: per follower; a connection may open MAX_OPEN_STREAMS streams at once.
INQ_MESSAGES = 2 * MAX_OPEN_STREAMS
PULLQ_MESSAGES = 4 * MAX_PULLS_PER_MEMBER
#: Bytes queued for either worker over every connection, at least.
QUEUED_BYTES = 256 << 20
KINDS = frozenset((MSG, BEGIN, CHUNK, END, PULL))


class Gate:
    """Screens and queues what the io thread receives (see the module docstring).

    Queues: per connection at most :data:`INQ_MESSAGES` messages for the consumer and, in
    bytes, one largest single message and 4 headers (chunks besides, bounded by the
    credits); :data:`PULLQ_MESSAGES` pull requests for the producer; for each, at most
    :data:`QUEUED_BYTES` over every connection (or two connections' worth, if more).

    Args:
        keys: the members' keys. limits: what a message of each kind carries at most.
        refusals: where drops are counted. credits: chunks received and not yet consumed, at
            most. open_on: ``connection -> push streams open on it`` (the consumer's).
        reply: sends a message at once (on the io thread's socket, never blocking).

    Attributes:
        inq: the consumer's queue (items ``(ident, kind, ...)``). pullq: the producer's.
    """

    def __init__(self, keys: Keyring, limits: MessageLimits, refusals: Refusals, credits: int,
                 open_on: Callable[[bytes], int], reply: Callable[[list], None]) -> None:
        self._keys, self.limits, self._refusals, self._open_on = keys, limits, refusals, open_on
        self._reply = reply
        self._credits: queue.SimpleQueue[None] = queue.SimpleQueue()  # C-level: no Condition
        for _ in range(credits):
            self._credits.put(None)
        header = limits.header_bytes + ENVELOPE_BYTES
        per_conn = limits.single_bytes + ENVELOPE_BYTES + 4 * header
        self.inq = FairQueue(INQ_MESSAGES, per_conn, max(QUEUED_BYTES, 2 * per_conn),
                             on_drop=self._dropped)
        self.pullq = FairQueue(PULLQ_MESSAGES, PULLQ_MESSAGES * header,
                               max(QUEUED_BYTES, 2 * PULLQ_MESSAGES * header),
                               on_drop=self._dropped)
        # Push streams announced (a BEGIN queued) and not yet opened, per connection: with the
        # streams open there, what lets a chunk or end of that connection in.
        self._begun: dict[bytes, int] = {}
        self._begun_lock = threading.Lock()

    def receive(self, frames: list[zmq.Frame], nbytes: int, stop: threading.Event,
                poll_s: float) -> None:
        """Screen one message (``nbytes`` after its routing id) and queue it, or drop it and
        count why. Zero-copy: the frames own the buffers libzmq received the message into.
        A chunk waits for a credit (checking ``stop`` every ``poll_s`` seconds)."""
        ident = frames[0].bytes
        kind = frames[1].bytes if len(frames) > 1 else b""
        if kind not in KINDS:
            return self._refusals("unknown_kind")
        if kind == CHUNK or kind == END:
            why = self.limits.check(kind, len(frames) - 2, nbytes)
            if why is not None:
                return self._refusals(why)
            if not self._begun.get(ident) and not self._open_on(ident):
                return self._refusals("unknown_stream")
            if kind == END:
                return self._queue(self.inq, ident, (ident, END, [f.buffer for f in frames[2:]]),
                                   nbytes)
            # [ident, C, meta, tag, data]; a malformed chunk fails its stream at the consumer.
            # Only 20 bytes of meta and 16 of tag matter: longer frames are cut, not copied.
            meta = frames[2].buffer[:64].tobytes() if len(frames) > 2 else b""
            item = ((ident, CHUNK, meta, frames[3].buffer[:64].tobytes(), frames[4])
                    if len(frames) == 5 else (ident, CHUNK, meta, b"", None))
            while True:  # a credit per chunk held: the consumer gives it back (chunk_done)
                try:
                    self._credits.get(timeout=poll_s)
                    break
                except queue.Empty:
                    if stop.is_set():
                        return None
            self.inq.put(ident, item, nbytes, force=True)
            return None
        if len(frames) < 3:
            return self._refusals("malformed")
        mk, why = self._keys.lookup(frames[2].buffer)
        if mk is None:
            return self._refusals(why)
        why = self.limits.check(kind, len(frames) - 2, nbytes)
        if why is not None:  # a member's (or a holder of its key id's): told, at a fixed cost
            most_frames, most_bytes = self.limits.most(kind)
            self._refusals(why)
            return self._reply(error_reply(mk.key, ident, Refused(
                Refusal.INVALID_ARGUMENT, f"a message of kind {kind.decode()!r} with "
                f"{len(frames) - 2} frames and {nbytes} bytes: its kind carries at most "
                f"{most_frames} frames and {most_bytes} bytes to this data server")))
        rest = [f.buffer for f in frames[2:]]
        if kind == PULL:
            return self._queue(self.pullq, ident, (ident, PULL, mk, rest), nbytes)
        if kind == BEGIN:
            with self._begun_lock:
                self._begun[ident] = self._begun.get(ident, 0) + 1
        return self._queue(self.inq, ident, (ident, kind, mk, rest), nbytes)

    def chunk_done(self) -> None:
        """The consumer is done with a chunk: its credit is free."""
        self._credits.put(None)

    def begin_done(self, ident: bytes) -> None:
        """A BEGIN of connection ``ident`` was handled (its stream opened or refused), or
        dropped: it no longer announces a stream."""
        with self._begun_lock:
            left = self._begun.get(ident, 0) - 1
            if left > 0:
                self._begun[ident] = left
            else:
                self._begun.pop(ident, None)

    def _queue(self, q: FairQueue, ident: bytes, item: tuple, nbytes: int) -> None:
        why = q.put(ident, item, nbytes)
        if why is not None:
            self._dropped(item, why)

    def _dropped(self, item: tuple, why: str = "evicted") -> None:
        if item[1] == BEGIN:
            self.begin_done(item[0])
        self._refusals(why)


__all__ = ["INQ_MESSAGES", "KINDS", "PULLQ_MESSAGES", "QUEUED_BYTES", "Gate"]
