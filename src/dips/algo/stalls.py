"""What a member's pushes and pulls say of its link: push-time estimates and stalls (§6, §7).

A member that holds a round — a push late, incomplete or failed, or a pull that never comes
under the pull barrier — owes 1, 2, 4, ... (at most :data:`MAX_OWED`) complete pushes, which
are sent ahead of their rounds until paid, so it holds one round per 1, 2, 4, ... of its
pushes and never the others' every round (reviews 14, 17, 18, 19, 20 of RELIABILITY.md).
The round's state machine (:func:`dips.algo.round.step`) calls :func:`scored` when a round is
decided and :func:`pull_stalls` when it ends. Pure: no clock, threads or I/O.
"""

from __future__ import annotations

import bisect

from dataclasses import replace

from dips.algo.round_types import Round, RoundPolicy, RoundState, UpdateOutcome

__all__ = ["LATE_FACTOR", "MAX_OWED", "pull_stalls", "scored"]

#: A push admitted into a round that took more than ``push_floor_s / 2 + LATE_FACTOR ×`` its
#: predicted time counts as not delivered in time, even complete (:func:`scored`).
LATE_FACTOR = 2.0

#: The most complete pushes a member owes before its pushes join rounds again (:func:`scored`):
#: after 7 incomplete ones, a member that stalls every round it is admitted to holds one round
#: in 64 of its pushes; an honest member with a flaky link only has its pushes sent ahead.
MAX_OWED = 64



def scored(state: RoundState, rnd: Round, outcome: UpdateOutcome,
           policy: RoundPolicy) -> RoundState:
    """``state`` with what round ``rnd``'s decided pushes say of their members' links.

    A push counts as fast only once it is known to have been delivered complete: reported
    delivered and scored (not in ``outcome.invalid``). Its measured time (admission to report)
    enters the member's moving average (never lowering it while the member owes), and counts
    toward what the member owes (below). Any other push — timed out, reported failed, dropped as
    its member left, reported delivered but found incomplete when scored, or admitted into a
    round and reported later than ``push_floor_s / 2 +`` :data:`LATE_FACTOR` × the smaller of
    its predicted time and the median push of the members that owe nothing, complete or not
    (review 18, B: 0.59× honest throughput; review 19: 0.76× just under a threshold of its own
    estimate) — counts as at least as slow as it took: the estimate never drops, and the
    member's pushes are sent ahead of their round until it has delivered complete pushes again:
    1 after its first such push, then twice as many after each further one (at most
    :data:`MAX_OWED`), so a member that stalls every round it is admitted to holds one round per
    1, 2, 4, ... of its pushes (review 14, F2: a member that stalled a round, then reported its
    pushes sent ahead as delivered with no data, was measured fast again and stalled the next
    round; review 17, C: one that sent complete pushes ahead and stalled every round it was then
    admitted to cut honest throughput to 0.61×). A push that failed with its round (followers
    not ready, ``excused``) or whose round failed as a whole (``outcome.error``) before it was
    scored says nothing of its member's link.
    """
    push_s, owed, stalls = dict(state.push_s), dict(state.send_ahead), dict(state.stalls)
    a = policy.estimate_alpha
    # The pushes of the members that owe nothing, sorted once per round: each member's
    # "others" are these without its own (the median of a round of 100 over 1,024 members).
    settled = sorted(v for k, v in state.push_s.items() if k not in state.send_ahead)
    for c, s in rnd.slots.items():
        if s.excused or s.admitted_at is None or s.reported_at is None:
            continue
        complete = s.ok and c not in outcome.invalid
        if complete and outcome.error:
            continue
        took = max(s.reported_at - s.admitted_at, 0.0)
        old = push_s.get(c)
        mean = took if old is None else a * took + (1 - a) * old
        # Held its round well past its prediction (review 18, B: complete pushes reported
        # just before their deadline, estimates lowered by instant reports sent ahead).
        # Judged against the others' median push too (review 19, B′: a member reporting just
        # under a threshold of its own estimate raised that estimate round after round).
        typical = _median_without(settled, state.push_s.get(c)
                                  if c not in state.send_ahead else None)
        pred = min(x for x in (s.expected_s, typical) if x is not None) \
            if (s.expected_s, typical) != (None, None) else None
        late = (not s.ahead and pred is not None
                and took > policy.push_floor_s / 2 + LATE_FACTOR * pred)
        if complete and not late:
            # While it owes, its estimate never drops: instant reports of pushes sent ahead
            # cannot make it look fast again before it has paid.
            push_s[c] = mean if old is None or c not in owed else max(old, mean)
            if owed.get(c, 0) > 1:
                owed[c] -= 1
            else:
                owed.pop(c, None)
        else:
            push_s[c] = mean if old is None else max(old, mean)
            _stalled(c, owed, stalls)
    return replace(state, push_s=push_s, send_ahead=owed, stalls=stalls)


def _median_without(values: list[float], own: float | None) -> float | None:
    """The upper median of sorted ``values`` less one occurrence of ``own`` (None: nothing
    removed; ``own`` must then be one of them), or None when nothing is left: the same element
    as ``sorted(values without own)[n // 2]``, found in O(log n)."""
    if own is None:
        return values[len(values) // 2] if values else None
    n = len(values) - 1
    if n <= 0:
        return None
    i, p = n // 2, bisect.bisect_left(values, own)
    return values[i] if i < p else values[i + 1]


def _stalled(cluster: str, owed: dict[str, int], stalls: dict[str, int]) -> None:
    """``cluster`` held a round (a push, or a pull under the barrier): one more stall, and it
    owes 1, 2, 4, ... (at most :data:`MAX_OWED`) complete pushes, sent ahead of their rounds."""
    stalls[cluster] = stalls.get(cluster, 0) + 1
    owed[cluster] = min(2 ** min(stalls[cluster] - 1, 30), MAX_OWED)


def pull_stalls(state: RoundState, policy: RoundPolicy) -> RoundState:
    """``state`` with a stall counted for each member that held the pull barrier (§6, the
    seed's round: ``grace.pull_barrier``) of the round ending now to its deadline: its push was
    delivered, it never reported its pull, and it owed nothing (a member that owes is not
    waited for, :func:`dips.algo.round._pulls_over`). Review 20, B: a member that took its
    verdict and never sent PullDone held every round it joined for ``pull_timeout_s`` (honest
    outer steps 0.074×); now it holds one round per 1, 2, 4, ... of its pushes, as a stalled
    push does."""
    rnd = state.current
    if not policy.grace.pull_barrier or not state.ready:
        return state  # no barrier, or the round ended because the followers stopped
    late = [c for c, s in sorted(rnd.slots.items())
            if s.ok and not s.pulled and c not in state.send_ahead]
    if not late:
        return state
    owed, stalls = dict(state.send_ahead), dict(state.stalls)
    for c in late:
        _stalled(c, owed, stalls)
    return replace(state, send_ahead=owed, stalls=stalls)
