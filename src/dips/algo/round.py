"""The leader's round as a pure state machine (§6, §7, §12 of the seed).

One outer step goes through the phases ``idle → window → push → update → pull``:

* **idle**: no round; push requests queue. When a request is queued and the followers are
  ready (all registered, up and reconciled), a round opens (§6: the server never updates
  with nothing to do).
* **window**: the first request opened the grace window (:mod:`dips.algo.grace`, fixed τ or
  the §7 τ*); every request arriving while it is open is admitted into the round.
* **push**: the window has closed (a :class:`Tick` at or after its close time); the admitted
  clusters' stage workers send their layers. The phase ends when every admitted push was
  reported (delivered or failed) or the push timeout passed (a late push fails).
* **update**: the caller scores, decides, aggregates and applies the round
  (:class:`StartUpdate`); its :class:`UpdateFinished` carries the outcome, from which every
  admitted push gets its :class:`Verdict` and every member's push-time estimate is updated
  (:func:`dips.algo.stalls.scored`: only a push delivered complete counts as fast; review 14, F2).
* **pull**: the round's clusters pull the new version. Without the pull barrier the round
  ends at once and the next window may open while they pull (a slow link delays only its own
  cluster); with ``grace.pull_barrier`` (the seed's §6 round) it ends when every cluster
  whose push was delivered has pulled, the pull timeout passed, or the followers stopped being
  ready. Requests during push, update and pull wait for the next round.

:func:`step` is the whole decision: ``step(state, event, policy) -> (state, actions)``, in
the style of torchft's ``quorum_compute(now, state, opt)``. Time is the ``now`` of each event
(seconds on the caller's clock: monotonic in the real leader, virtual in
:mod:`dips.emu.virtual`); the window and the timeouts end only on a :class:`Tick`, which the
caller sends at :func:`next_deadline`. States, events and actions are immutable; a refused
event raises :class:`dips.algo.refusal.Refused` and changes nothing. The real leader
(:mod:`dips.roles.leader`) feeds gRPC calls, heartbeats and its clock in and carries the
actions out; the virtual-time engine drives the very same function with its virtual clock.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from dips.algo import grace as grace_rules
from dips.algo.refusal import Refusal, Refused
from dips.algo.stalls import MAX_OWED, pull_stalls, scored
from dips.algo.round_types import (
    Phase, RejectCode, RoundPolicy, Slot, Round, Verdict, UpdateOutcome, RoundState,
    PushRequested, PushWithdrawn, PushReported, UpdateFinished, PullDone, MemberGone,
    ReadyChanged, Tick, RunFinished, Event, RoundOpened, Admitted, Staged, WindowClosed, StartUpdate, Decided,
    RoundEnded, Action)

__all__ = [
    "step", "next_deadline", "slot_of", "push_deadline", "pull_deadline", "verdicts_of",
    "hopeless", "MAX_OWED", "Phase", "RejectCode", "RoundPolicy", "Slot", "Round", "Verdict",
    "UpdateOutcome", "RoundState", "PushRequested", "PushWithdrawn", "PushReported",
    "UpdateFinished", "PullDone", "MemberGone", "ReadyChanged", "Tick", "RunFinished", "Event",
    "RoundOpened", "Admitted", "Staged", "WindowClosed", "StartUpdate", "Decided", "RoundEnded",
    "Action"]


# ----- queries ---------------------------------------------------------------------------
def next_deadline(state: RoundState, policy: RoundPolicy) -> float | None:
    """When the caller must send the next :class:`Tick` (seconds), or None: only events."""
    rnd = state.current
    if rnd is None:
        return None
    if state.phase is Phase.WINDOW:
        return rnd.closes_at
    if state.phase is Phase.PUSH:
        return rnd.push_deadline
    if state.phase is Phase.PULL and policy.grace.pull_barrier:
        return rnd.pull_deadline
    return None


def slot_of(state: RoundState, cluster_id: str) -> Slot | None:
    """The cluster's request: sent ahead, queued, or in the current round; None if none."""
    if cluster_id in state.staging:
        return state.staging[cluster_id]
    for s in state.queue:
        if s.cluster_id == cluster_id:
            return s
    return state.current.slots.get(cluster_id) if state.current else None


def hopeless(state: RoundState, cluster_id: str, expected_s: float | None,
             policy: RoundPolicy) -> bool:
    """Whether a push predicted to take ``expected_s`` seconds would hold the others' round
    (see :class:`RoundPolicy`: ``stage_min_s``, ``stage_ratio``)."""
    others = sorted(v for c, v in state.push_s.items() if c != cluster_id)
    if expected_s is None or not others or expected_s < policy.stage_min_s:
        return False
    typical = others[len(others) // 2]
    return expected_s > policy.stage_ratio * typical


# ----- transitions -----------------------------------------------------------------------
def step(state: RoundState, event: Event, policy: RoundPolicy) -> tuple[RoundState, list[Action]]:
    """Apply ``event`` to ``state``; returns the new state and the actions to carry out.

    Raises:
        Refused: RUN_FINISHED (a request after :class:`RunFinished`), PUSH_IN_FLIGHT (a
            second request while one is queued or not yet pulled), INVALID_ARGUMENT (tokens
            <= 0, negative base version), UNKNOWN_PUSH (a report for a push that is not in the
            current round); the state is then unchanged.
        ValueError: an :class:`UpdateFinished` for a round that is not being updated.
        TypeError: an unknown event.
    """
    actions: list[Action] = []
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise TypeError(f"unknown round event {event!r}")
    state = handler(state, event, policy, actions)
    return _advance(state, event, policy, actions), actions


def _on_request(state: RoundState, ev: PushRequested, policy: RoundPolicy,
                actions: list[Action]) -> RoundState:
    if state.finished:
        raise Refused(Refusal.RUN_FINISHED, f"the run finished ({state.finished}): cluster "
                                            f"{ev.cluster_id!r} may not push")
    if ev.tokens <= 0:
        raise Refused(Refusal.INVALID_ARGUMENT, f"push field 'tokens' = {ev.tokens} must be > 0")
    if ev.base_version < 0:
        raise Refused(Refusal.INVALID_ARGUMENT,
                      f"push field 'base_version' = {ev.base_version} must be >= 0")
    mine = slot_of(state, ev.cluster_id)
    if mine is not None and (mine.round is None or not mine.pulled):
        # A cluster that pulled (pull barrier) or left may queue for the next round.
        raise Refused(Refusal.PUSH_IN_FLIGHT, f"cluster {ev.cluster_id!r} already has a push "
                                              f"in flight (push id {mine.push_id})")
    arrivals = state.grace
    # λ of §7; a clock step back is ignored
    if not arrivals.arrivals or ev.now >= arrivals.arrivals[-1]:
        arrivals = grace_rules.observe_request(arrivals, ev.now)
    # The longer of the leader's measurement and the member's own prediction: claiming less
    # cannot shorten the wait below what was measured, claiming more only sends its own push
    # ahead (and no round waits beyond push_timeout_s). A member whose last push was not
    # delivered complete is sent ahead whatever it predicts (review 14, F2).
    known = [x for x in (state.push_s.get(ev.cluster_id), ev.expected_s) if x is not None]
    expected = max(known) if known else None
    slot = Slot(ev.cluster_id, ev.push_id, ev.base_version, ev.tokens, ev.now, expected)
    state = replace(state, grace=arrivals)
    if ev.cluster_id in state.send_ahead or hopeless(state, ev.cluster_id, expected, policy):
        slot = replace(slot, admitted_at=ev.now)
        actions.append(Staged(slot))
        return replace(state, staging={**state.staging, ev.cluster_id: slot})
    if state.phase is Phase.WINDOW and mine is None:  # one push per cluster and round
        return _admit(state, [slot], actions, ev.now)
    return replace(state, queue=(*state.queue, slot))


def _on_withdrawn(state: RoundState, ev: PushWithdrawn, policy: RoundPolicy,
                  actions: list[Action]) -> RoundState:
    return replace(state, queue=tuple(s for s in state.queue if s.push_id != ev.push_id))


def _on_reported(state: RoundState, ev: PushReported, policy: RoundPolicy,
                 actions: list[Action]) -> RoundState:
    ahead = state.staging.get(ev.cluster_id)
    if ahead is not None and ahead.push_id == ev.push_id:
        # A push sent ahead has arrived (or failed): it joins the open window or the next
        # round as already reported, so no round waits for its transfer.
        slot = replace(ahead, done=True, ok=ev.ok, error=ev.error, code=ev.code,
                       reported_at=ev.now, ahead=True)
        state = replace(state, staging={c: s for c, s in state.staging.items()
                                        if c != ev.cluster_id})
        in_round = state.current is not None and ev.cluster_id in state.current.slots
        if state.phase is Phase.WINDOW and not in_round:
            return _admit(state, [slot], actions, ev.now)
        return replace(state, queue=(*state.queue, slot))
    rnd = state.current
    slot = rnd.slots.get(ev.cluster_id) if rnd else None
    if slot is None or slot.push_id != ev.push_id:
        if ev.push_id in state.verdicts:  # already decided: the verdict is re-served
            return state
        raise Refused(Refusal.UNKNOWN_PUSH, f"push id {ev.push_id!r} of cluster "
                                            f"{ev.cluster_id!r} is not part of the current round")
    if slot.done or state.phase not in (Phase.WINDOW, Phase.PUSH):
        return state  # its fate is sealed (timed out, or the round is being decided)
    return _with_slot(state, replace(slot, done=True, ok=ev.ok, error=ev.error,
                                     code=ev.code, reported_at=ev.now))


def _on_update_finished(state: RoundState, ev: UpdateFinished, policy: RoundPolicy,
                        actions: list[Action]) -> RoundState:
    rnd = state.current
    if state.phase is not Phase.UPDATE or rnd is None or rnd.number != ev.round:
        raise ValueError(f"update of round {ev.round} finished, but the machine is in phase "
                         f"{state.phase.value} of round {rnd.number if rnd else None}")
    verdicts = verdicts_of(rnd, ev.outcome)
    kept = dict(state.verdicts)
    for v in verdicts:
        kept[v.push_id] = v
    while len(kept) > policy.verdicts_kept:
        del kept[next(iter(kept))]
    rnd = replace(rnd, update_done=ev.now,
                  pull_deadline=pull_deadline(rnd, ev.now, policy, state.pull_s))
    actions.append(Decided(rnd.number, tuple(verdicts), rnd))
    state = scored(state, rnd, ev.outcome, policy)
    return replace(state, phase=Phase.PULL, current=rnd, verdicts=kept)


def _on_pull_done(state: RoundState, ev: PullDone, policy: RoundPolicy,
                  actions: list[Action]) -> RoundState:
    slot = state.current.slots.get(ev.cluster_id) if state.current else None
    if slot is None or slot.pulled or state.phase is not Phase.PULL:
        return state  # only a pull of the decided version counts
    rnd = state.current
    if policy.grace.pull_barrier and rnd.update_done is not None:
        took = max(ev.now - rnd.update_done, 0.0)
        old = state.pull_s.get(ev.cluster_id)
        a = policy.estimate_alpha
        state = replace(state, pull_s={**state.pull_s, ev.cluster_id:
                                       took if old is None else a * took + (1 - a) * old})
    return _with_slot(state, replace(slot, pulled=True))


def _on_gone(state: RoundState, ev: MemberGone, policy: RoundPolicy,
             actions: list[Action]) -> RoundState:
    state = replace(state, queue=tuple(s for s in state.queue if s.cluster_id != ev.cluster_id),
                    staging={c: s for c, s in state.staging.items() if c != ev.cluster_id})
    slot = state.current.slots.get(ev.cluster_id) if state.current else None
    if slot is None:
        return state
    if not slot.done or state.phase in (Phase.WINDOW, Phase.PUSH):
        # Dropped from the round even if delivered: its data chunks go back to the ledger
        # now, so its push must not be applied too (issue 10). In the update phase it is too
        # late to drop it: the caller credits it instead (its chunks wait for the verdict).
        slot = replace(slot, done=True, ok=False, error=ev.reason, code=ev.code,
                       reported_at=ev.now if slot.reported_at is None else slot.reported_at)
    return _with_slot(state, replace(slot, pulled=True))


def _on_ready(state: RoundState, ev: ReadyChanged, policy: RoundPolicy,
              actions: list[Action]) -> RoundState:
    state = replace(state, ready=ev.ready)
    rnd = state.current
    if ev.ready or rnd is None or state.phase not in (Phase.WINDOW, Phase.PUSH):
        return state
    # A follower down or restarted: no push of this round can complete on every shard, so the
    # round ends now instead of at its deadline (§12: a fault stays a local event).
    if state.phase is Phase.WINDOW:
        actions.append(WindowClosed(rnd.number, ev.now))
    code = RejectCode.FOLLOWERS_NOT_READY.value
    failed = {c: replace(s, done=True, ok=False, error=ev.reason, code=code, excused=True)
              for c, s in rnd.slots.items() if not s.done or s.ok}
    return replace(state, phase=Phase.PUSH,
                   current=replace(rnd, slots={**rnd.slots, **failed}, push_deadline=ev.now))


def _on_tick(state: RoundState, ev: Tick, policy: RoundPolicy,
             actions: list[Action]) -> RoundState:
    rnd = state.current
    if rnd is None:
        return state
    if state.phase is Phase.WINDOW and ev.now >= rnd.closes_at:
        actions.append(WindowClosed(rnd.number, ev.now))
        # Members that owe complete pushes do not set a fresh member's deadline (review 19, C′).
        honest = {c: v for c, v in state.push_s.items() if c not in state.send_ahead}
        rnd = replace(rnd, push_deadline=push_deadline(rnd, ev.now, policy, honest))
        return replace(state, phase=Phase.PUSH, current=rnd)
    if state.phase is Phase.PUSH and ev.now >= rnd.push_deadline:
        # A push that never arrived counts as one that took this long, and its member's
        # pushes are sent ahead of their round once it is decided
        # (:func:`dips.algo.stalls.scored`; issue 13: a stalling member holds one round).
        late = {c: replace(s, done=True, ok=False, error="push not delivered in time",
                           code=RejectCode.NOT_DELIVERED.value, reported_at=ev.now)
                for c, s in rnd.slots.items() if not s.done}
        return replace(state, current=replace(rnd, slots={**rnd.slots, **late}))
    return state


def _on_finished(state: RoundState, ev: RunFinished, policy: RoundPolicy,
                 actions: list[Action]) -> RoundState:
    if state.finished:
        return state
    return replace(state, finished=ev.reason or "finished", queue=(), staging={})


_HANDLERS: dict[type, Any] = {
    PushRequested: _on_request, PushWithdrawn: _on_withdrawn, PushReported: _on_reported,
    UpdateFinished: _on_update_finished, PullDone: _on_pull_done, MemberGone: _on_gone,
    ReadyChanged: _on_ready, Tick: _on_tick, RunFinished: _on_finished,
}


def _with_slot(state: RoundState, slot: Slot) -> RoundState:
    rnd = state.current
    return replace(state, current=replace(rnd, slots={**rnd.slots, slot.cluster_id: slot}))


def push_deadline(rnd: Round, closed_at: float, policy: RoundPolicy,
                  measured: Mapping[str, float] | None = None) -> float:
    """When round ``rnd``'s push phase gives up on missing pushes (seconds): every member gets
    ``push_floor_s + push_slack ×`` its predicted push time from its admission, the round at
    most ``push_timeout_s`` after the close. A member without a prediction counts as the
    median push ``measured`` so far (cluster -> seconds; the upper median), not the slowest:
    a colluder that made its own pushes look slow cannot stretch the first round of a fresh
    identity (review 18, C); with nothing measured at all, the round waits the timeout."""
    bound = closed_at + policy.push_timeout_s
    typical = sorted(measured.values())[len(measured) // 2] if measured else None
    if policy.push_slack == float("inf"):
        return bound
    due = closed_at
    for s in rnd.slots.values():
        expected = s.expected_s if s.expected_s is not None else typical
        if expected is None or s.admitted_at is None:
            return bound
        due = max(due, s.admitted_at + policy.push_floor_s + policy.push_slack * expected)
    return min(bound, due)


def pull_deadline(rnd: Round, update_done: float, policy: RoundPolicy,
                  measured: Mapping[str, float]) -> float:
    """When the pull barrier (``grace.pull_barrier``) of round ``rnd``, decided at
    ``update_done``, stops waiting (seconds): ``push_floor_s + push_slack ×`` the slowest
    measured pull (``measured``: cluster -> seconds) of its members whose push was delivered,
    at most ``pull_timeout_s`` after ``update_done``. A member never measured counts as the
    median measured pull (the upper median), as for pushes (:func:`push_deadline`); with none
    measured, the barrier waits the timeout. Review 20: the barrier waited the fixed
    ``pull_timeout_s`` (60 s) whatever the pulls took."""
    bound = update_done + policy.pull_timeout_s
    if policy.push_slack == float("inf"):
        return bound
    typical = sorted(measured.values())[len(measured) // 2] if measured else None
    due = update_done
    for c, s in rnd.slots.items():
        if not s.ok:
            continue  # nobody waits for its pull
        expected = measured.get(c, typical)
        if expected is None:
            return bound
        due = max(due, update_done + policy.push_floor_s + policy.push_slack * expected)
    return min(bound, due)


def verdicts_of(rnd: Round, outcome: UpdateOutcome) -> tuple[Verdict, ...]:
    """One verdict per admitted push of ``rnd`` from its update's ``outcome`` (cluster order)."""
    accepted = set(outcome.accepted)
    out = []
    for c in sorted(rnd.slots):
        s = rnd.slots[c]
        ok = c in accepted
        reason = "accepted" if ok else outcome.invalid.get(
            c, outcome.error or "penalty: score above threshold")
        out.append(Verdict(s.push_id, c, rnd.number, ok, outcome.version, reason,
                           outcome.scores.get(c), outcome.thresholds.get(c),
                           outcome.clip_factor))
    return tuple(out)


def _admit(state: RoundState, slots: list[Slot], actions: list[Action], now: float) -> RoundState:
    rnd = state.current
    admitted = {}
    for s in slots:
        # A push sent ahead keeps the time it was sent: its push time is measured from there.
        s = replace(s, round=rnd.number, admitted_at=s.admitted_at if s.ahead else now)
        admitted[s.cluster_id] = s
        actions.append(Admitted(s))
    return replace(state, current=replace(rnd, slots={**rnd.slots, **admitted}))


def _advance(state: RoundState, ev: Event, policy: RoundPolicy,
             actions: list[Action]) -> RoundState:
    """Transitions that follow from the state alone (no time passes here)."""
    now = ev.now
    while True:
        rnd = state.current
        if state.phase is Phase.IDLE:
            if not (state.queue and state.ready):
                return state
            number = state.rounds + 1
            closes = now + grace_rules.window_s(state.grace, policy.grace)
            actions.append(RoundOpened(number, now, closes))
            queued, state = state.queue, replace(state, phase=Phase.WINDOW, rounds=number, queue=(),
                                                 current=Round(number, now, closes))
            state = _admit(state, list(queued), actions, now)
        elif state.phase is Phase.PUSH and all(s.done for s in rnd.slots.values()):
            actions.append(StartUpdate(rnd.number, tuple(rnd.slots[c] for c in sorted(rnd.slots))))
            state = replace(state, phase=Phase.UPDATE, current=replace(rnd, update_started=now))
        elif state.phase is Phase.PULL and _pulls_over(state, policy, now):
            state = _end_round(state, now, policy, actions)
        else:
            return state


def _pulls_over(state: RoundState, policy: RoundPolicy, now: float) -> bool:
    rnd = state.current
    if not policy.grace.pull_barrier or not state.ready or now >= rnd.pull_deadline:
        return True
    return all(s.pulled or not s.ok or c in state.send_ahead for c, s in rnd.slots.items())


def _end_round(state: RoundState, now: float, policy: RoundPolicy,
               actions: list[Action]) -> RoundState:
    rnd = state.current
    push_s = rnd.update_started - rnd.closes_at
    update_s = rnd.update_done - rnd.update_started
    pull_s = now - rnd.update_done
    grace = grace_rules.observe_round(state.grace, max(update_s, 0.0), max(pull_s, 0.0))
    state = pull_stalls(state, policy)
    actions.append(RoundEnded(rnd.number, rnd.closes_at - rnd.opened_at, push_s, update_s,
                              pull_s, grace_rules.stats(grace, policy.grace)))
    return replace(state, phase=Phase.IDLE, current=None, grace=grace)
