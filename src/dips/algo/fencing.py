"""One leader at a time: terms (fencing tokens) and a follower's leader lease (§5, §12).

Every leader process takes a term one higher than the last one persisted in its state
directory, before it acts. Every control call it makes carries the term; a follower keeps
the highest term it has accepted and when it last heard from that leader (a call, or the
reply to its own registration). The rules, in :func:`offer`:

* a lower term is refused with ``STALE_TERM``: that leader steps down;
* the same term renews the lease;
* a higher term is accepted only once the current leader's lease has expired (``lease_s``
  without a word from it), else refused with ``LEASE_HELD`` and the seconds left.

So a leader restarted by an orchestrator takes over within ``lease_s`` of the old one's
death, while a stale copy started beside a live leader (a second process, a copy of its
state directory, a partition healing) cannot roll back a step the live one prepared: it
keeps being refused and steps down (:func:`give_up`). This is lease-based fencing as in
Chubby and in Kleppmann's fencing tokens; time is passed in (monotonic seconds).
"""

from __future__ import annotations

from dataclasses import dataclass

from dips.algo.refusal import Refusal


@dataclass(frozen=True)
class LeaderLease:
    """What a follower knows of its leader.

    Attributes:
        term: the highest term accepted (0: none yet).
        renewed_at: when that leader was last heard from (monotonic seconds), None: not
            since this process started (a restarted follower holds no lease).
    """

    term: int = 0
    renewed_at: float | None = None

    def left(self, now: float, lease_s: float) -> float:
        """Seconds until the lease expires (0 when expired or never held)."""
        if self.renewed_at is None:
            return 0.0
        return max(0.0, lease_s - (now - self.renewed_at))


@dataclass(frozen=True)
class Offer:
    """The outcome of a term offered to a follower.

    ``lease``: the follower's lease afterwards; ``refusal``: None (accepted), STALE_TERM or
    LEASE_HELD; ``left_s``: with LEASE_HELD, seconds until the current lease expires;
    ``adopted``: a higher term was taken (persist it before acting on the call).
    """

    lease: LeaderLease
    refusal: Refusal | None = None
    left_s: float = 0.0
    adopted: bool = False


def offer(lease: LeaderLease, term: int, now: float, lease_s: float) -> Offer:
    """Apply a leader's ``term`` (from a call or a registration reply) to ``lease`` at ``now``.

    Raises ValueError if ``term`` < 1 or ``lease_s`` <= 0.
    """
    if term < 1:
        raise ValueError(f"leader term = {term} must be >= 1")
    if lease_s <= 0:
        raise ValueError(f"lease_s = {lease_s} must be > 0")
    if term < lease.term:
        return Offer(lease, Refusal.STALE_TERM)
    if term == lease.term:
        return Offer(LeaderLease(term, now))
    left = lease.left(now, lease_s)
    if left > 0:
        return Offer(lease, Refusal.LEASE_HELD, left)
    return Offer(LeaderLease(term, now), adopted=True)


def term_of(starts: int, nonce: int) -> int:
    """The term of a leader's ``starts``-th start (>= 1) with a random ``nonce`` in
    [0, 2**31): ordered by starts first, and unique across processes started from copies of
    one state directory (same count, different nonce). Raises ValueError out of range."""
    if not 1 <= starts < 2**31 or not 0 <= nonce < 2**31:
        raise ValueError(f"term_of({starts}, {nonce}): starts in [1, 2**31), nonce in [0, 2**31)")
    return (starts << 31) | nonce


def starts_of(term: int) -> int:
    """The start count of a term made by :func:`term_of`."""
    return term >> 31


def give_up(held_since: float, now: float, lease_s: float) -> bool:
    """Whether a leader refused with LEASE_HELD continuously since ``held_since`` should step
    down: past two lease periods, the lease it waits for is being renewed by a live leader
    (a dead one's would have expired after one)."""
    return now - held_since > 2 * lease_s


def lease_seconds(heartbeat_interval_s: float, missed_heartbeats: int) -> float:
    """A leader's lease: as long as a member may stay silent before it is presumed dead
    (§12: ``missed_heartbeats`` intervals)."""
    return heartbeat_interval_s * missed_heartbeats
