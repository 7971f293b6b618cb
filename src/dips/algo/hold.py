"""When a cluster stops training until it can sync again: the hold (review 15, #2; §12).

§12 keeps faults local: while the leader or a follower is unreachable, a cluster goes on with
its local model. But what it trains then is only worth something if a push can carry it:

* a push carries at most one sync interval's tokens to the weights (the leader weighs it as
  ``push_tokens_weighed``), and the penalty (§8) compares its ‖Δ‖² with the recent pushes'
  — a review's 28 s leader restart had both surviving clusters' next pushes, each about 28
  intervals of training, rejected, their data rewound and trained again;
* while a verdict is pending, what is trained after the push is thrown away when the verdict
  comes (the cluster goes on from the ledger's positions, pulling the new model);
* while a re-join is pending, everything since the last pull is thrown away by the re-join
  (it pulls one complete model and starts from the ledger's positions).

So a cluster *holds* — trains no further inner step, keeps its data position and its model,
and tries the sync again (with its backoff) — when a re-join or a verdict is pending, or when
it has trained ``hold_after`` sync intervals (``hold_after × H`` inner steps) past its last
completed sync without being able to complete one (the leader unreachable, the followers not
ready). Its next push then carries at most ``hold_after`` intervals: a normal push for the
default ``hold_after = 1``, which the penalty takes like any other. ``hold_after = None``
never holds (the behaviour before: train on, and lose the outage's work to the penalty).

What ends a failed sync's wait, and when it is tried again (§7, §12; issue 16): a cluster
that trained its H inner steps asks to push (``RequestPush``) and waits until the leader
admits it into a grace window (§7) or sends it ahead of any round. The wait has a deadline,
the cluster's ``timeouts.admit_s`` (30 s by default): the call's gRPC deadline, of which the
leader waits what is left. A request still waiting at its deadline is withdrawn (the round
machine's :class:`~dips.algo.round.PushWithdrawn`; the ledger drops its progress report), the
call fails with ``NOT_ADMITTED``, and the cluster tries again after its backoff
(:func:`next_backoff`), holding meanwhile with the default ``hold_after = 1`` (its sync is
due: no further step) and asking again with the same progress. :func:`admission` is that
wait's decision, taken by the leader's ``request_push`` (:mod:`dips.roles.leader_push`) at
each wake-up and by ``dips simulate`` at a request's deadline (before issue 16 the simulator
let a request wait as long as it took). The backoff of a cluster's failed syncs
(:mod:`dips.roles.client`): :data:`BACKOFF_FIRST_S` after the first failure, doubling with
each further one up to :data:`BACKOFF_MAX_S`, back to the first after a completed sync (its
pull) or a join.

Pure: the caller passes its counters, what is pending, the round machine's state and the time
(monotonic seconds).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import NamedTuple

from dips.algo.round import slot_of
from dips.algo.round_types import RoundState, Slot

__all__ = ["AdmitWait", "Admission", "BACKOFF_FIRST_S", "BACKOFF_MAX_S", "Hold", "POLL_S",
           "admission", "hold", "next_backoff"]

#: The longest one wait of a hold lasts (seconds) before the caller looks again (a stop
#: request, the run's end, a leader back before the backoff ran out).
POLL_S = 1.0


@dataclass(frozen=True)
class Hold:
    """A cluster must not train now.

    Attributes:
        reason: ``"re-join pending"``, ``"verdict pending"`` or ``"sync overdue"`` (for
            logs and records; control flow reads the attributes below, never this text).
        wait_s: seconds to wait before the next try (0: try now), at most :data:`POLL_S`.
        steps_since_sync: inner steps trained since the last completed sync.
    """

    reason: str
    wait_s: float
    steps_since_sync: int


def hold(steps_since_sync: int, H: int, hold_after: int | None, *, rejoin_pending: bool,
         verdict_pending: bool, now: float, retry_at: float,
         poll_s: float = POLL_S) -> Hold | None:
    """Whether a cluster holds now (module docstring); None: it may train.

    Args:
        steps_since_sync: inner steps since its last completed sync (verdict or join), >= 0.
        H: inner steps of one sync interval (>= 1).
        hold_after: sync intervals it may train past its last completed sync (>= 1), None:
            never hold.
        rejoin_pending, verdict_pending: what the cluster waits for.
        now, retry_at: the time (monotonic seconds) and when its backoff lets it try again.
        poll_s: the longest wait returned (seconds, > 0).

    Raises:
        ValueError: a count, H, ``hold_after`` or ``poll_s`` out of range, or a time that is
            not finite (naming the argument and its value).
    """
    for name, v, lo in (("steps_since_sync", steps_since_sync, 0), ("H", H, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} = {v!r} must be an int >= {lo}")
    if hold_after is not None and (isinstance(hold_after, bool) or not isinstance(hold_after, int)
                                   or hold_after < 1):
        raise ValueError(f"hold_after = {hold_after!r} must be an int >= 1 or None")
    for name, t in (("now", now), ("retry_at", retry_at), ("poll_s", poll_s)):
        if not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ValueError(f"{name} = {t!r} must be a finite number of seconds")
    if poll_s <= 0:
        raise ValueError(f"poll_s = {poll_s!r} must be > 0")
    if hold_after is None:
        return None
    if rejoin_pending:
        reason = "re-join pending"
    elif verdict_pending:
        reason = "verdict pending"
    elif steps_since_sync >= hold_after * H:
        reason = "sync overdue"
    else:
        return None
    return Hold(reason, min(poll_s, max(0.0, retry_at - now)), steps_since_sync)


#: Seconds a cluster waits before its next try after a first failed sync (or join, pull).
BACKOFF_FIRST_S = 0.5
#: The longest backoff, seconds.
BACKOFF_MAX_S = 10.0


class Admission(enum.Enum):
    """Where a waiting push request stands."""

    ADMITTED = "admitted"      # in the current round (its grant names the round)
    SENT_AHEAD = "sent ahead"  # staged ahead of any round (round 0)
    DROPPED = "dropped"        # no longer the leader's (the cluster left, was removed, re-joined)
    FINISHED = "finished"      # dropped because the run finished
    WAITING = "waiting"        # queued, its deadline not reached
    WITHDRAW = "withdraw"      # queued at its deadline: to be withdrawn


class AdmitWait(NamedTuple):
    """:func:`admission`'s answer: ``what``, the request's slot (None once dropped) and the
    seconds left to its deadline (0.0 unless ``WAITING``)."""

    what: Admission
    slot: Slot | None
    left_s: float


def admission(state: RoundState, cluster_id: str, push_id: str, deadline_s: float,
              now: float) -> AdmitWait:
    """Where push ``push_id`` of ``cluster_id``, requested with deadline ``deadline_s``
    (seconds, the caller's clock), stands at ``now`` in the round machine's ``state``.

    Raises:
        ValueError: ``deadline_s`` or ``now`` not a finite number (naming it).
    """
    for name, v in (("deadline_s", deadline_s), ("now", now)):
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} = {v!r} must be a finite number of seconds")
    slot = slot_of(state, cluster_id)
    if slot is None or slot.push_id != push_id:
        return AdmitWait(Admission.FINISHED if state.finished else Admission.DROPPED, None, 0.0)
    if slot.round is not None:
        return AdmitWait(Admission.ADMITTED, slot, 0.0)
    if state.staging.get(cluster_id) is slot:
        return AdmitWait(Admission.SENT_AHEAD, slot, 0.0)
    left = deadline_s - now
    if left <= 0:
        return AdmitWait(Admission.WITHDRAW, slot, 0.0)
    return AdmitWait(Admission.WAITING, slot, left)


def next_backoff(backoff_s: float) -> float:
    """The backoff after one more failure, from the current one (seconds): twice it, at most
    :data:`BACKOFF_MAX_S`.

    Raises:
        ValueError: ``backoff_s`` not a finite number > 0 (naming it).
    """
    if not isinstance(backoff_s, (int, float)) or not (math.isfinite(backoff_s) and backoff_s > 0):
        raise ValueError(f"backoff_s = {backoff_s!r} must be a finite number > 0 (seconds)")
    return min(BACKOFF_MAX_S, 2.0 * backoff_s)
