"""Per-member limits on concurrent control calls, so that one member cannot starve the rest.

The leader's gRPC server has a fixed pool of handler threads, and two of its calls block by
design: ``RequestPush`` waits for a grace window, ``PushDone`` for the round's verdict. A
member that holds a push and sends more requests would otherwise park one thread per call
until none is left for anyone's heartbeat (issue 13: one held push plus 13 queued requests
took all 12 threads; an honest cluster's heartbeats hit their deadline and it was removed).

:class:`CallGate` counts the calls in progress and refuses, at once and with
``Refusal.BUSY``, a call that would exceed

* ``per_call`` blocking calls of one method by one member (a member has one push request
  and one verdict wait at a time; a second is a retry that must wait for the first to end),
* ``per_member`` calls of any method by one member,
* ``blocking`` blocking calls over all members together: the server's other threads stay
  free for heartbeats, follower registrations and status reads, which never block.

A refused call costs its thread microseconds; nothing is queued.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

from dips.algo.ratelimit import Bucket, check_rate, take
from dips.algo.refusal import Refusal, Refused

#: Calls that wait for an event of the round (seconds to minutes) instead of answering.
BLOCKING = frozenset({"RequestPush", "PushDone"})
#: Threads kept free of blocking calls (heartbeats, registrations, status).
RESERVED_THREADS = 6
#: Calls that only read (answered from the leader's state): rate-limited per member by the
#: server (:class:`RateGate`, ``make_server(reads=...)``), as no honest member makes more
#: than a few a second.
READS = frozenset({"GetStatus", "GetSpec"})
#: A cluster's and a follower's heartbeat (a follower's registration doubles as one):
#: rate-limited per member by the server from the run's heartbeat interval
#: (``make_server(heartbeats=...)``, :func:`dips.algo.ratelimit.heartbeat_limit`).
HEARTBEATS = frozenset({"Heartbeat", "RegisterFollower"})


class CallGate:
    """Counts calls in progress per member and method (thread-safe).

    Args:
        blocking: blocking calls (:data:`BLOCKING`) in progress at once over all members.
        per_member: calls of one member in progress at once.
        per_call: blocking calls of one method by one member in progress at once.

    Raises:
        ValueError: a limit below 1.
    """

    def __init__(self, blocking: int, per_member: int = 6, per_call: int = 1) -> None:
        if min(blocking, per_member, per_call) < 1:
            raise ValueError(f"call limits blocking={blocking}, per_member={per_member}, "
                             f"per_call={per_call} must be >= 1")
        self.blocking, self.per_member, self.per_call = blocking, per_member, per_call
        self._lock = threading.Lock()
        self._calls: dict[tuple[str, str], int] = {}
        self._members: dict[str, int] = {}
        self._blocking = 0

    @classmethod
    def for_server(cls, max_workers: int) -> "CallGate":
        """Limits for a server of ``max_workers`` handler threads: blocking calls leave
        :data:`RESERVED_THREADS` threads free (at least one may block)."""
        return cls(blocking=max(1, max_workers - RESERVED_THREADS))

    @contextlib.contextmanager
    def enter(self, member: str, method: str) -> Iterator[None]:
        """Hold a place for ``member``'s call of ``method`` for the ``with`` block.

        Raises Refused(BUSY) naming the limit when there is no place (nothing is held then).
        """
        key = (member, method)
        blocks = method in BLOCKING
        with self._lock:
            if blocks and self._calls.get(key, 0) >= self.per_call:
                raise Refused(Refusal.BUSY, f"{member}: a {method} call of this member is "
                                            "already in progress: retry when it ended")
            if self._members.get(member, 0) >= self.per_member:
                raise Refused(Refusal.BUSY, f"{member}: {self.per_member} calls of this member "
                                            "in progress: retry later")
            if blocks and self._blocking >= self.blocking:
                raise Refused(Refusal.BUSY, f"{member}: {self.blocking} waiting calls in "
                                            f"progress at the leader: retry {method} later")
            self._calls[key] = self._calls.get(key, 0) + 1
            self._members[member] = self._members.get(member, 0) + 1
            self._blocking += blocks
        try:
            yield
        finally:
            with self._lock:
                self._calls[key] -= 1
                if not self._calls[key]:
                    del self._calls[key]
                self._members[member] -= 1
                if not self._members[member]:
                    del self._members[member]
                self._blocking -= blocks

    def in_progress(self) -> int:
        """Calls in progress now (for tests and status)."""
        with self._lock:
            return sum(self._members.values())


#: Calls one peer (a certificate's identity) may have open at one control server, counted
#: from the moment the call's headers arrive, before its request message: above
#: :class:`CallGate`'s 6 running calls per member, far below the server's own bound.
PEER_CALLS = 16


class PeerCalls:
    """Counts the open calls of each peer at one server (thread-safe), so that calls one
    member opens and never completes cannot use what others need (issue 13, review 25: 20
    connections x 8 held calls of one certificate filled gRPC's server-wide limit and every
    other call, honest heartbeats too, was refused RESOURCE_EXHAUSTED).

    Args:
        limit: open calls per peer.

    Raises:
        ValueError: ``limit`` below 1.
    """

    def __init__(self, limit: int = PEER_CALLS) -> None:
        if limit < 1:
            raise ValueError(f"peer call limit {limit} must be >= 1")
        self.limit = limit
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}
        self.refused = 0  # calls refused so far (for status and tests)

    def open(self, peer: str) -> None:
        """Count a call of ``peer``. Raises Refused(BUSY) naming the limit when it has
        ``limit`` open (nothing is counted then); every open call is :meth:`close` d once."""
        with self._lock:
            held = self._open.get(peer, 0)
            if held >= self.limit:
                self.refused += 1
                raise Refused(Refusal.BUSY, f"{peer}: {self.limit} calls of this peer open at "
                                            "this server (PEER_CALLS): retry when one ended")
            self._open[peer] = held + 1

    def close(self, peer: str) -> None:
        with self._lock:
            left = self._open.get(peer, 0) - 1
            if left > 0:
                self._open[peer] = left
            else:
                self._open.pop(peer, None)

    def of(self, peer: str) -> int:
        """Open calls of ``peer`` now (for tests and status)."""
        with self._lock:
            return self._open.get(peer, 0)


#: Read calls per second and burst per member by default (``membership.read_calls_per_s``,
#: ``membership.read_burst``): an honest member reads a few times a minute (a join's spec, a
#: liveness probe or ``dips status`` every second or so).
READ_CALLS_PER_S = 20.0
READ_BURST = 40
#: Members whose buckets are kept before full ones are forgotten (a full bucket is new).
MAX_BUCKETS = 4096


class RateGate:
    """A token bucket (:func:`dips.algo.ratelimit.take`) per member (thread-safe): refuses,
    with ``Refusal.BUSY`` (RESOURCE_EXHAUSTED) naming the limit, a member's calls beyond
    ``rate`` per second after a burst of ``burst`` (issue 13, review 25 M1: 1,093 GetStatus
    calls/s of one member took 0.64 of a core of the leader).

    Args:
        rate: calls per second of one member, sustained.
        burst: calls one member may make at once after a quiet while.
        clock: seconds of a monotonic clock (default ``time.monotonic``; tests pass theirs).
        what: the setting's name, for the refusal's message.

    Raises:
        ValueError: ``rate`` not > 0 or ``burst`` < 1 (naming the field).
    """

    def __init__(self, rate: float = READ_CALLS_PER_S, burst: float = READ_BURST,
                 clock: Callable[[], float] = time.monotonic,
                 what: str = "membership.read_calls_per_s") -> None:
        check_rate(rate, burst)
        self.rate, self.burst, self.what = rate, burst, what
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, Bucket] = {}
        self.refused = 0  # calls refused so far (for status and tests)

    def take(self, member: str, method: str) -> None:
        """Count one call of ``member``; Raises Refused(BUSY) when over its rate."""
        with self._lock:
            now = self._clock()
            if len(self._buckets) >= MAX_BUCKETS and member not in self._buckets:
                self._forget_full(now)
            bucket, ok = take(self._buckets.get(member), now, self.rate, self.burst)
            self._buckets[member] = bucket
            self.refused += not ok
        if not ok:
            raise Refused(Refusal.BUSY, f"{member}: {method}: more than {self.rate:g} such "
                                        f"calls per second (burst {self.burst:g}) of this "
                                        f"member ({self.what}): retry later")

    def _forget_full(self, now: float) -> None:
        full_after = self.burst / self.rate
        for member in [m for m, b in self._buckets.items() if now - b.at >= full_after]:
            del self._buckets[member]
