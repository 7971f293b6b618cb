"""What a data server serves and how it refuses (:mod:`dips.wire.dataplane`): the protocols of
the roles behind it (single messages, push sinks, pull sources), typed error replies and the
members' pull budgets (issue 13: hostile peers). Refusals are counted and logged by
:mod:`dips.wire.refusals` (at most one line per interval).

A handler refuses with :class:`~dips.algo.refusal.Refused` (its code travels in the reply's
``code`` field) or ``ValueError`` (:class:`~dips.wire.frames.FrameError` included:
INVALID_ARGUMENT). Any other exception is a bug the input found: the reply says UNSPECIFIED
without the exception's text, and the traceback is logged once per kind.

What a member's pulls may hold (issue 13, a member that pulls and never reads): every
message a pull sends is handed to libzmq with a tracker, and counts against its member
(:class:`PullLedger`) until libzmq released it — written to the connection, or dropped with
it. Per member (identity) and data server, at most :data:`MAX_PULLS_PER_MEMBER` pull
streams are in flight (being produced, or not yet all written), and its pull messages and
single-message pull replies not yet written hold at most :data:`PULL_BYTES_PER_MEMBER` plus
one message (a single-message reply holds at most :data:`SINGLE_REPLY_BYTES`); a pull beyond
either is refused BUSY at once. Each connection queues at most :data:`SEND_HWM` messages
(``ZMQ_SNDHWM``); libzmq refuses more, and they are dropped (its peer does not read).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Protocol, Sequence

import torch

from dips.algo.refusal import Refusal, Refused
from dips.wire.dataclient import MSG
from dips.wire.frames import Message, encode
from dips.wire.pki import Identity
from dips.wire.refusals import Incidents
from dips.wire.stream import TensorSpec

Handler = Callable[[Message], tuple[dict[str, Any], Sequence[tuple[str, torch.Tensor]]]]
#: ``authorize(sender, header)``: raise Refused(FORBIDDEN) if ``sender`` may not send it.
Authorize = Callable[[Identity, dict[str, Any]], None]


def allow_all(sender: Identity, header: dict[str, Any]) -> None:
    """The default :data:`Authorize`: every member may send anything."""
    return None


class PushSink(Protocol):
    """Where the chunks of one pushed transfer go (called from the consumer thread). A sink
    may also have a ``revoked`` attribute: true once the role no longer wants the transfer
    (its round closed); the server then drops the stream and refuses it STALE_GRANT."""

    def write(self, index: int, offset: int, data: memoryview) -> None: ...
    def commit(self) -> dict[str, Any]: ...
    def abort(self, reason: str) -> None: ...


class PullSource(Protocol):
    """What one pull stream sends: ``header``, ``specs``, then ``tensor(i)`` for each spec;
    ``finish()`` raises ValueError if what was sent is no longer valid (then no END is sent).
    A source may also have ``close()``, called once when the stream's messages (zero-copy
    views of the source's tensors) were written, or when it was dropped or failed: whatever
    the source holds for it is released then, not before."""

    header: dict[str, Any]
    specs: list[TensorSpec]

    def tensor(self, index: int) -> torch.Tensor: ...
    def finish(self) -> None: ...


class StreamHandler(Protocol):
    """Opens the sink of a pushed stream or the source of a pulled one; raises to refuse."""

    def open_push(self, header: dict[str, Any], specs: list[TensorSpec]) -> PushSink: ...
    def open_pull(self, header: dict[str, Any]) -> PullSource: ...


def streams_of(handler: Any) -> StreamHandler | None:
    """The object ``handler`` is a bound method of, if it serves streams (e.g. a follower's
    ``shard.handle``), else None."""
    owner = getattr(handler, "__self__", None)
    if owner is not None and hasattr(owner, "open_push") and hasattr(owner, "open_pull"):
        return owner
    return None


#: What a handler raises to refuse a request (the reply names it, with INVALID_ARGUMENT for a
#: ValueError, FrameError included); anything else is a bug (UNSPECIFIED, logged).
REFUSED = (ValueError, Refused)
#: Push streams one connection may have open at once (each holds a sink on the follower).
MAX_OPEN_STREAMS = 64
#: Pull streams one member (identity: a cluster's stage workers share theirs) may have in
#: flight at once on one data server: from its request until libzmq has written (or dropped)
#: its last message. A cluster's stage workers each pull from a follower one at a time, so
#: this covers clusters whose layers on one follower span up to 4 stages.
MAX_PULLS_PER_MEMBER = 4
#: Bytes of one member's pulls handed to libzmq and not yet written to their connections, at
#: most (plus the one message that crossed it): streams wait beyond, new pulls are BUSY.
PULL_BYTES_PER_MEMBER = 32 << 20
#: The largest reply to a single-message pull (bytes): one member's pull budget. A larger
#: read is a stream (:class:`dips.wire.workers.SingleMessages`).
SINGLE_REPLY_BYTES = PULL_BYTES_PER_MEMBER
#: Bytes and messages of one pull stream handed to libzmq and not yet written, at most: the
#: stream waits for its peer beyond (a credit window, so one stream cannot take a member's
#: whole budget and a slow peer stalls only its own streams).
PULL_WINDOW_BYTES = 16 << 20
PULL_WINDOW_MESSAGES = 64
#: Messages queued for one connection at most (the ROUTER's ``ZMQ_SNDHWM``); an honest peer
#: has at most a pull window and one reply per open push stream outstanding.
SEND_HWM = 1024


def error_reply(key: bytes, ident: bytes, exc: BaseException, xfer: bytes | None = None) -> list:
    """An error reply; ``code`` is the :class:`Refusal` the client decides on."""
    code = exc.code if isinstance(exc, Refused) else (
        Refusal.INVALID_ARGUMENT if isinstance(exc, ValueError) else Refusal.UNSPECIFIED)
    text = str(exc) if isinstance(exc, REFUSED) else f"internal error: {type(exc).__name__}"
    head = {"op": "error", "error": text[:1000], "code": int(code)}
    if xfer is not None:
        head["xfer"] = xfer.hex()
    return [ident, MSG, *encode(key, head)]


class PullLedger:
    """What each member's pulls hold on one data server (thread-safe; see the module
    docstring). ``member`` is the identity's name.

    A pull is admitted (:meth:`admit`) or refused BUSY; each message it sends is counted
    (:meth:`handed`) until its tracker says libzmq released it. A stream being produced keeps
    its own window of trackers (and reports each one done with :meth:`written`); what an ended
    stream or a single-message reply still has unwritten is handed over as a *tail*
    (:meth:`finish`) and reaped here. A stream counts as in flight until its tail is empty.

    Args:
        max_streams: streams in flight per member (:data:`MAX_PULLS_PER_MEMBER`).
        max_bytes: unwritten bytes per member (:data:`PULL_BYTES_PER_MEMBER`).

    Attributes:
        admitted, refused: pulls admitted, and refused BUSY, so far.
    """

    def __init__(self, max_streams: int = MAX_PULLS_PER_MEMBER,
                 max_bytes: int = PULL_BYTES_PER_MEMBER) -> None:
        if max_streams < 1 or max_bytes < 1:
            raise ValueError(f"max_streams = {max_streams}, max_bytes = {max_bytes} must be >= 1")
        self.max_streams, self.max_bytes = max_streams, max_bytes
        self._lock = threading.Lock()
        self._streams: dict[str, int] = {}
        self._held: dict[str, int] = {}
        self._tails: dict[str, list[tuple[deque, bool]]] = {}  # (window, a stream's)
        self.admitted = self.refused = 0

    def admit(self, member: str, stream: bool) -> None:
        """Admit a pull of ``member`` (a stream: counted in flight until :meth:`finish` and
        its tail written). Raises Refused(BUSY) beyond either limit; nothing is counted then."""
        with self._lock:
            self._reap(member)
            streams, held = self._streams.get(member, 0), self._held.get(member, 0)
            if (stream and streams >= self.max_streams) or held >= self.max_bytes:
                self.refused += 1
                raise Refused(Refusal.BUSY, f"{member!r} has {streams} pull streams in flight and "
                                            f"{held} bytes of pulls not yet read (at most "
                                            f"{self.max_streams} and {self.max_bytes}): read "
                                            "them first")
            if stream:
                self._streams[member] = streams + 1
            self.admitted += 1

    def room(self, member: str) -> bool:
        """Whether ``member``'s streams may hand libzmq more now (its unwritten bytes are
        under the limit; tails are reaped by :meth:`reap`, so this errs on the safe side)."""
        return self._held.get(member, 0) < self.max_bytes

    def handed(self, member: str, nbytes: int) -> None:
        """``nbytes`` of ``member``'s pulls were handed to libzmq."""
        with self._lock:
            self._held[member] = self._held.get(member, 0) + nbytes

    def written(self, member: str, nbytes: int) -> None:
        """``nbytes`` counted by :meth:`handed` were released by libzmq."""
        with self._lock:
            self._held[member] = self._held.get(member, 0) - nbytes

    def finish(self, member: str, window: deque, stream: bool) -> None:
        """A pull stops sending (``stream``: a stream, in flight until ``window`` is written);
        ``window`` holds ``(tracker, bytes)`` of what it handed over and libzmq still holds,
        oldest first."""
        with self._lock:
            if window:
                self._tails.setdefault(member, []).append((window, stream))
            elif stream:
                self._streams[member] = self._streams.get(member, 0) - 1
            self._reap(member)

    def reap(self) -> None:
        """Uncount what libzmq released of every member's tails."""
        with self._lock:
            for member in list(self._tails):
                self._reap(member)

    def _reap(self, member: str) -> None:
        tails = self._tails.get(member)
        if not tails:
            self._tidy(member)
            return
        freed, ended, kept = 0, 0, []
        for tail, stream in tails:  # one connection's messages: written (released) in order
            while tail and tail[0][0].done:
                freed += tail.popleft()[1]
            if tail:
                kept.append((tail, stream))
            elif stream:
                ended += 1
        self._held[member] = self._held.get(member, 0) - freed
        self._streams[member] = self._streams.get(member, 0) - ended
        if kept:
            self._tails[member] = kept
        else:
            del self._tails[member]
        self._tidy(member)

    def _tidy(self, member: str) -> None:
        if not self._streams.get(member) and not self._held.get(member) \
                and member not in self._tails:
            self._streams.pop(member, None)
            self._held.pop(member, None)

    def held(self, member: str | None = None) -> int:
        """Unwritten bytes of ``member``'s pulls (None: every member's), after reaping."""
        self.reap()
        with self._lock:
            if member is None:
                return sum(self._held.values())
            return self._held.get(member, 0)

    def streams(self, member: str | None = None) -> int:
        """Pull streams of ``member`` (None: every member's) in flight, after reaping."""
        self.reap()
        with self._lock:
            if member is None:
                return sum(self._streams.values())
            return self._streams.get(member, 0)


#: (cluster, round) pairs whose push connections a data server remembers.
PUSH_ROUNDS_KEPT = 256


class PushConnections:
    """Distinct connections (ZeroMQ routing ids) that sent accepted push data, per (cluster,
    round), the newest :data:`PUSH_ROUNDS_KEPT` kept: a member's stage workers each hold one
    connection per follower (§5, §10), so this counts a cluster's stage workers on this
    follower. Thread-safe."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, int], set[bytes]] = {}
        self._lock = threading.Lock()

    def note(self, ident: bytes, header: dict) -> None:
        """Count ``ident`` among the connections of the accepted push ``header`` (its
        ``cluster`` and ``round`` were checked by the stream handler)."""
        key = (str(header.get("cluster")), int(header.get("round", -1)))
        with self._lock:
            self._seen.setdefault(key, set()).add(bytes(ident))
            while len(self._seen) > PUSH_ROUNDS_KEPT:
                self._seen.pop(next(iter(self._seen)))

    def count(self, cluster: str, rnd: int) -> int:
        """How many distinct connections sent push data of ``cluster`` for round ``rnd`` (0
        if none, or forgotten)."""
        with self._lock:
            return len(self._seen.get((cluster, int(rnd)), ()))


__all__ = ["MAX_OPEN_STREAMS", "MAX_PULLS_PER_MEMBER", "PULL_BYTES_PER_MEMBER",
           "PULL_WINDOW_BYTES", "PULL_WINDOW_MESSAGES", "PUSH_ROUNDS_KEPT", "REFUSED", "SEND_HWM",
           "SINGLE_REPLY_BYTES",
           "Authorize", "PushConnections",
           "Handler", "Incidents", "PullLedger", "PullSource", "PushSink", "StreamHandler",
           "allow_all", "error_reply", "streams_of"]
