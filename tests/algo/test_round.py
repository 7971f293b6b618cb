"""The leader's round machine (dips.algo.round) against hand-worked event sequences (§6, §7)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dips.algo import grace as grace_rules
from dips.algo.refusal import Refusal, Refused
from dips.algo.round import (MAX_OWED, Admitted, Decided, MemberGone, Phase, PullDone, PushReported,
                             PushRequested, PushWithdrawn, ReadyChanged, RoundOpened,
                             RoundPolicy, RoundState, RunFinished, Tick, UpdateFinished,
                             UpdateOutcome, WindowClosed, hopeless, next_deadline, slot_of, step)
from dips.spec.protocol import GraceConfig


def policy(window_s=8.0, mode="fixed", barrier=False, push_timeout_s=60.0, pull_timeout_s=60.0,
           max_s=30.0):
    return RoundPolicy(GraceConfig(mode=mode, window_s=window_s, max_s=max_s, pull_barrier=barrier),
                       push_timeout_s=push_timeout_s, pull_timeout_s=pull_timeout_s)


def req(now, c, tokens=100, base=0):
    return PushRequested(now, c, f"p-{c}-{now}", base, tokens)


def run(events, pol, state=None):
    """Apply events in order; returns (state, all actions)."""
    state = state or RoundState()
    out = []
    for ev in events:
        state, acts = step(state, ev, pol)
        out += acts
    return state, out


def kinds(actions):
    return [type(a).__name__ for a in actions]


def test_seed_11_four_clusters_three_share_the_step_d_waits():
    """§11: A at 100 s opens an 8 s window; B (103 s) and C (106 s) join; D (180 s) does not."""
    pol = policy(window_s=8.0)
    s, acts = run([req(100.0, "A")], pol)
    assert kinds(acts) == ["RoundOpened", "Admitted"]
    assert acts[0] == RoundOpened(1, 100.0, 108.0)
    assert s.phase is Phase.WINDOW and next_deadline(s, pol) == 108.0
    s, acts = run([req(103.0, "B"), req(106.0, "C"), Tick(107.9)], pol, s)
    assert kinds(acts) == ["Admitted", "Admitted"] and s.phase is Phase.WINDOW
    s, acts = run([Tick(108.0)], pol, s)
    assert acts == [WindowClosed(1, 108.0)] and s.phase is Phase.PUSH
    assert next_deadline(s, pol) == 168.0  # push timeout counts from the close
    s, acts = run([PushReported(109.0, "A", s.current.slots["A"].push_id, True),
                   PushReported(110.0, "B", s.current.slots["B"].push_id, True)], pol, s)
    assert acts == []
    s, acts = run([PushReported(111.0, "C", s.current.slots["C"].push_id, True)], pol, s)
    assert kinds(acts) == ["StartUpdate"] and s.phase is Phase.UPDATE
    assert [x.cluster_id for x in acts[0].slots] == ["A", "B", "C"]
    out = UpdateOutcome(version=1, accepted=("A", "B"), scores={"A": -0.5, "B": 0.5, "C": 76.5},
                        thresholds={"A": 6.0, "B": 6.0, "C": 6.0}, clip_factor=1.0)
    s, acts = run([UpdateFinished(112.0, 1, out)], pol, s)
    assert kinds(acts) == ["Decided", "RoundEnded"] and s.phase is Phase.IDLE
    v = {x.cluster_id: x for x in acts[0].verdicts}
    assert v["A"].accepted and v["B"].accepted and not v["C"].accepted
    assert v["C"].reason == "penalty: score above threshold" and v["C"].score == 76.5
    assert {x.version for x in v.values()} == {1}
    ended = acts[1]
    assert (ended.window_s, ended.push_s, ended.update_s, ended.pull_s) == (8.0, 3.0, 1.0, 0.0)
    assert v["C"].threshold == 6.0
    s, acts = run([req(180.0, "D")], pol, s)
    assert acts[0] == RoundOpened(2, 180.0, 188.0)


def test_requests_during_push_and_update_queue_for_the_next_round():
    pol = policy(window_s=1.0)
    s, _ = run([req(0.0, "a"), Tick(1.0), req(1.5, "b")], pol)
    assert s.phase is Phase.PUSH and [q.cluster_id for q in s.queue] == ["b"]
    s, acts = run([PushReported(2.0, "a", s.current.slots["a"].push_id, True)], pol, s)
    s, acts = run([req(2.5, "c"), UpdateFinished(3.0, 1, UpdateOutcome(1, ("a",)))], pol, s)
    # The round ends at the update and the queue opens the next one at the same instant.
    assert kinds(acts) == ["Decided", "RoundEnded", "RoundOpened", "Admitted", "Admitted"]
    assert s.current.number == 2 and set(s.current.slots) == {"b", "c"}
    assert s.current.opened_at == 3.0


def test_run_finished_ends_the_round_in_flight_and_opens_no_other():
    pol = policy(window_s=1.0)
    s, _ = run([req(0.0, "a"), Tick(1.0), req(1.5, "b")], pol)
    s, acts = run([RunFinished(1.6, "token budget")], pol, s)
    assert acts == [] and s.finished == "token budget" and s.queue == ()  # b's request dropped
    assert slot_of(s, "b") is None and s.phase is Phase.PUSH
    with pytest.raises(Refused) as info:
        step(s, req(1.7, "c"), pol)
    assert info.value.code is Refusal.RUN_FINISHED and "token budget" in info.value.message
    s, acts = run([PushReported(2.0, "a", s.current.slots["a"].push_id, True),
                   UpdateFinished(3.0, 1, UpdateOutcome(1, ("a",)))], pol, s)
    assert kinds(acts) == ["StartUpdate", "Decided", "RoundEnded"]  # and no RoundOpened
    assert s.phase is Phase.IDLE and s.current is None
    assert run([RunFinished(4.0, "max time")], pol, s)[0].finished == "token budget"


def test_push_timeout_fails_late_pushes_only():
    pol = policy(window_s=0.0, push_timeout_s=5.0)
    s, _ = run([req(0.0, "a")], pol)
    s, acts = run([req(0.0, "b"), Tick(0.0)], pol, s)
    s, _ = run([PushReported(1.0, "a", s.current.slots["a"].push_id, True), Tick(4.9)], pol, s)
    assert s.phase is Phase.PUSH
    s, acts = run([Tick(5.0)], pol, s)
    assert kinds(acts) == ["StartUpdate"]
    slots = {x.cluster_id: x for x in acts[0].slots}
    assert slots["a"].ok and not slots["b"].ok
    assert slots["b"].error == "push not delivered in time"
    assert (slots["a"].code, slots["b"].code) == ("", "not_delivered")
    # A report arriving after the timeout changes nothing.
    s2, acts = run([PushReported(6.0, "b", slots["b"].push_id, True)], pol, s)
    assert acts == [] and s2 == s


def test_pull_barrier_waits_for_delivered_pushes_only():
    pol = policy(window_s=0.0, barrier=True, pull_timeout_s=30.0)
    s, _ = run([req(0.0, "a"), req(0.0, "b"), Tick(0.0)], pol)
    s, _ = run([PushReported(1.0, "a", s.current.slots["a"].push_id, True),
                PushReported(1.0, "b", s.current.slots["b"].push_id, False, "refused")], pol, s)
    s, acts = run([UpdateFinished(2.0, 1, UpdateOutcome(1, ("a",), invalid={"b": "refused"}))],
                  pol, s)
    assert kinds(acts) == ["Decided"] and s.phase is Phase.PULL
    assert next_deadline(s, pol) == 32.0
    assert {v.cluster_id: v.reason for v in acts[0].verdicts}["b"] == "refused"
    # a pulled and requests again: it queues (it is no longer in flight)
    s, acts = run([PullDone(3.0, "a")], pol, s)
    assert kinds(acts) == ["RoundEnded"] and acts[0].pull_s == 1.0  # b's push failed: not waited for


def test_pull_barrier_ends_at_timeout_or_when_followers_stop_being_ready():
    pol = policy(window_s=0.0, barrier=True, pull_timeout_s=10.0)
    base, _ = run([req(0.0, "a"), Tick(0.0)], pol)
    base, _ = run([PushReported(1.0, "a", base.current.slots["a"].push_id, True),
                   UpdateFinished(2.0, 1, UpdateOutcome(1, ("a",)))], pol, base)
    s, acts = run([Tick(11.9)], pol, base)
    assert acts == [] and s.phase is Phase.PULL
    s, acts = run([Tick(12.0)], pol, base)
    assert kinds(acts) == ["RoundEnded"]
    s, acts = run([ReadyChanged(5.0, False)], pol, base)
    assert kinds(acts) == ["RoundEnded"] and s.phase is Phase.IDLE
    # While not ready, requests queue and no round opens; readiness opens it.
    s, acts = run([req(6.0, "a")], pol, s)
    assert acts == [] and s.phase is Phase.IDLE
    s, acts = run([ReadyChanged(7.0, True)], pol, s)
    assert kinds(acts) == ["RoundOpened", "Admitted"]


def test_the_pull_barrier_waits_for_the_measured_pulls_not_the_timeout():
    """Review 20: the barrier waited the fixed pull timeout whatever the pulls took. Once
    pulls are measured it waits push_floor_s + push_slack × the slowest predicted pull of the
    members whose push was delivered (a member never measured counts as the median), at most
    the timeout; with nothing measured, the timeout."""
    pol = RoundPolicy(GraceConfig(window_s=0.0, pull_barrier=True), push_timeout_s=60.0,
                      pull_timeout_s=60.0, push_floor_s=2.0, push_slack=4.0)

    def round_of(s, t, members, pulls):
        s, _ = run([req(t, c, base=s.rounds) for c in members] + [Tick(t)], pol, s)
        s, _ = run([PushReported(t + 1, c, s.current.slots[c].push_id, True) for c in members]
                   + [UpdateFinished(t + 2, s.current.number,
                                     UpdateOutcome(s.rounds, tuple(members)))], pol, s)
        deadline = next_deadline(s, pol)
        s, _ = run([PullDone(t + 2 + d, c) for c, d in pulls.items()], pol, s)
        return s, deadline - (t + 2)

    s, wait = round_of(RoundState(), 0.0, ["a", "b"], {"a": 1.0, "b": 3.0})
    assert wait == 60.0  # nothing measured yet
    assert s.pull_s == {"a": 1.0, "b": 3.0} and s.phase is Phase.IDLE
    s, wait = round_of(s, 100.0, ["a", "b"], {"a": 1.0, "b": 3.0})
    assert wait == 2.0 + 4.0 * 3.0  # b's pull predicts the round's
    s, wait = round_of(s, 200.0, ["a", "c"], {"a": 1.0, "c": 1.0})
    assert wait == 2.0 + 4.0 * 3.0  # c unmeasured: the upper median (b's 3 s)
    slow = replace(s, pull_s={**s.pull_s, "b": 100.0})
    _, wait = round_of(slow, 300.0, ["b"], {"b": 1.0})
    assert wait == 60.0  # never beyond the timeout


def test_a_member_that_never_reports_its_pull_holds_one_barrier_per_1_2_4_pushes():
    """Review 20, B: under the pull barrier a member that took its verdict and never sent
    PullDone held every round it joined until the pull timeout (honest outer steps 0.074×).
    Now holding the barrier to its deadline is a stall: the member owes complete pushes, and
    no barrier waits for it while it owes."""
    pol = policy(window_s=0.0, barrier=True, pull_timeout_s=10.0)
    s, held, t = RoundState(), [], 0.0
    for _ in range(8):
        for c in ("a", "h"):  # each member has one push requested, queued or sent ahead
            if slot_of(s, c) is None and c not in s.staging:
                s, _ = run([req(t, c)], pol, s)
        if s.phase is Phase.WINDOW:
            s, _ = run([Tick(t)], pol, s)
        late = [PushReported(t + 1, c, x.push_id, True)
                for c, x in [*s.current.slots.items(), *s.staging.items()] if not x.done]
        s, _ = run([*late, Tick(t + 1)], pol, s)
        members = tuple(sorted(s.current.slots))
        s, _ = run([UpdateFinished(t + 2, s.current.number, UpdateOutcome(1, members))], pol, s)
        waits = "h" in members and "h" not in s.send_ahead
        s, acts = run([PullDone(t + 3, c) for c in members if c != "h"], pol, s)  # h never does
        if "RoundEnded" not in kinds(acts):
            s, acts = run([Tick(t + 2 + 10.0)], pol, s)  # the barrier's deadline
        assert "RoundEnded" in kinds(acts)
        held.append(waits)
        t += 20.0
    # h's pushes, sent ahead while it owes, join every other round. It held the barrier at its
    # 1st push (then owed 1), at its 2nd (owed 2), at its 4th (owed 4): one round per 1, 2, 4
    # of its pushes. Every other round ended at a's pull.
    assert held == [True, False, True, False, False, False, True, False]
    assert s.stalls["h"] == 3 and s.send_ahead["h"] == 4 and "a" not in s.stalls


def test_refusals_leave_the_state_unchanged():
    pol = policy(window_s=1.0, barrier=True)
    s, _ = run([req(0.0, "a")], pol)
    for bad, code in [(req(0.5, "a"), Refusal.PUSH_IN_FLIGHT),
                      (req(0.5, "b", tokens=0), Refusal.INVALID_ARGUMENT),
                      (req(0.5, "b", base=-1), Refusal.INVALID_ARGUMENT),
                      (PushReported(0.5, "a", "other-id", True), Refusal.UNKNOWN_PUSH),
                      (PushReported(0.5, "zz", "x", True), Refusal.UNKNOWN_PUSH)]:
        with pytest.raises(Refused) as info:
            step(s, bad, pol)
        assert info.value.code is code
    with pytest.raises(ValueError, match="not being updated|phase"):
        step(s, UpdateFinished(1.0, 1, UpdateOutcome(1)), pol)


def test_a_pulled_cluster_may_queue_for_the_next_round_under_the_barrier():
    pol = policy(window_s=0.0, barrier=True)
    s, _ = run([req(0.0, "a"), req(0.0, "b"), Tick(0.0)], pol)
    s, _ = run([PushReported(1.0, c, s.current.slots[c].push_id, True) for c in "ab"], pol, s)
    s, _ = run([UpdateFinished(2.0, 1, UpdateOutcome(1, ("a", "b"))), PullDone(3.0, "a")], pol, s)
    with pytest.raises(Refused):
        step(s, req(3.5, "b"), pol)  # b has not pulled yet
    s, acts = run([req(3.5, "a")], pol, s)
    assert acts == [] and slot_of(s, "a").round is None
    s, acts = run([PullDone(4.0, "b")], pol, s)
    assert kinds(acts) == ["RoundEnded", "RoundOpened", "Admitted"]


def test_member_gone_fails_its_push_and_drops_its_request():
    pol = policy(window_s=0.0)
    s, _ = run([req(0.0, "a"), req(0.0, "b"), Tick(0.0), req(0.5, "c")], pol)
    s, _ = run([PushReported(1.0, "a", s.current.slots["a"].push_id, True)], pol, s)
    s, acts = run([MemberGone(2.0, "b", "heartbeat timeout"), MemberGone(2.0, "c", "left")],
                  pol, s)
    assert kinds(acts) == ["StartUpdate"] and s.queue == ()
    assert {x.cluster_id: x.error for x in acts[0].slots}["b"] == "heartbeat timeout"
    assert {x.cluster_id: x.code for x in acts[0].slots}["b"] == "cluster_gone"


def test_withdrawn_request_leaves_the_queue():
    pol = policy(window_s=0.0)
    s, _ = run([req(0.0, "a"), Tick(0.0), req(1.0, "b")], pol)
    pid = s.queue[0].push_id
    s, _ = run([PushWithdrawn(2.0, "b", pid)], pol, s)
    assert s.queue == () and slot_of(s, "b") is None


def test_decided_verdicts_are_reserved_by_push_id():
    pol = replace(policy(window_s=0.0), verdicts_kept=2)
    s = RoundState()
    ids = []
    for k, c in enumerate("abc"):
        s, acts = run([req(10.0 * k, c), Tick(10.0 * k)], pol, s)
        ids.append(s.current.slots[c].push_id)
        s, _ = run([PushReported(10.0 * k + 1, c, ids[-1], True),
                    UpdateFinished(10.0 * k + 2, k + 1, UpdateOutcome(k + 1, (c,)))], pol, s)
    assert list(s.verdicts) == ids[1:]  # the oldest was dropped
    s2, acts = run([PushReported(99.0, "c", ids[2], True)], pol, s)  # asking again is fine
    assert acts == [] and s2.verdicts[ids[2]].accepted


def test_dynamic_grace_uses_tau_star_once_estimated():
    pol = policy(window_s=2.0, mode="dynamic", max_s=30.0)
    s = RoundState()
    # Requests every 0.25 s (λ = 4/s) and update + pull = 1 s (C_m = 1): τ* = ln(4)/4.
    s, acts = run([req(0.0, "a"), req(0.25, "b"), req(0.5, "c")], pol, s)
    assert acts[0].closes_at == 2.0  # no C_m yet: the fixed window
    s, _ = run([Tick(2.0)], pol, s)
    s, _ = run([PushReported(2.0, c, s.current.slots[c].push_id, True) for c in "abc"], pol, s)
    s, _ = run([UpdateFinished(3.0, 1, UpdateOutcome(1, ("a", "b", "c")))], pol, s)
    assert s.grace.miss_cost_s == 1.0
    s, acts = run([req(0.75, "d")], pol, s)  # arrivals 0, .25, .5, .75 -> λ = 3 / 0.75 s
    lam = 3 / 0.75
    assert acts[0].closes_at == pytest.approx(0.75 + math.log(1.0 * lam) / lam)
    assert grace_rules.window_s(s.grace, pol.grace) == pytest.approx(math.log(4) / 4)


def test_step_never_mutates_its_input():
    pol = policy(window_s=1.0)
    s0 = RoundState()
    s1, _ = step(s0, req(0.0, "a"), pol)
    assert s0 == RoundState() and s1 is not s0
    snapshot = s1
    step(s1, Tick(1.0), pol)
    assert s1 == snapshot and s1.phase is Phase.WINDOW


EVENTS = st.lists(st.tuples(st.sampled_from(["req", "report", "fail", "update", "pull", "gone",
                                             "tick", "ready", "unready"]),
                            st.sampled_from("abcd"), st.floats(0.0, 3.0)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(EVENTS, st.booleans(), st.floats(0.0, 2.0))
def test_random_histories_keep_the_invariants(events, barrier, window):
    """Every admitted push gets exactly one verdict; round numbers are consecutive; a cluster
    never has two requests in flight; phases follow the cycle."""
    pol = policy(window_s=window, barrier=barrier, push_timeout_s=5.0, pull_timeout_s=5.0)
    s, now, version, n = RoundState(), 0.0, 0, 0
    admitted, decided, opened = [], [], []
    for kind, c, dt in events:
        now += dt
        n += 1
        rnd = s.current
        try:
            if kind == "req":
                ev = PushRequested(now, c, f"{c}{n}", 0, 10)
            elif kind in ("report", "fail") and rnd and c in rnd.slots:
                ev = PushReported(now, c, rnd.slots[c].push_id, kind == "report")
            elif kind == "update" and s.phase is Phase.UPDATE:
                ok = tuple(x for x, sl in sorted(rnd.slots.items()) if sl.ok)
                version += bool(ok)
                ev = UpdateFinished(now, rnd.number, UpdateOutcome(version, ok))
            elif kind == "pull":
                ev = PullDone(now, c)
            elif kind == "gone":
                ev = MemberGone(now, c, "left")
            elif kind in ("ready", "unready"):
                ev = ReadyChanged(now, kind == "ready")
            else:
                ev = Tick(now)
            s, acts = step(s, ev, pol)
        except Refused as exc:
            assert exc.code in (Refusal.PUSH_IN_FLIGHT, Refusal.UNKNOWN_PUSH)
            continue
        for a in acts:
            if isinstance(a, Admitted):
                admitted.append(a.slot.push_id)
            elif isinstance(a, Decided):
                decided += [v.push_id for v in a.verdicts]
            elif isinstance(a, RoundOpened):
                opened.append(a.number)
        busy = [q.cluster_id for q in s.queue]
        assert len(busy) == len(set(busy))
        assert (s.current is None) == (s.phase is Phase.IDLE)
    assert opened == list(range(1, len(opened) + 1))
    assert len(decided) == len(set(decided)) and set(decided) <= set(admitted)
    pending = set(s.current.slots[c].push_id for c in s.current.slots) if s.current else set()
    assert set(admitted) - set(decided) <= pending


def test_a_member_that_left_may_request_again_while_its_old_push_is_decided():
    pol = policy(window_s=0.0)
    s, _ = run([req(0.0, "a"), req(0.0, "b"), Tick(0.0)], pol)
    with pytest.raises(Refused):  # a pull outside the pull phase does not release a push
        run([PullDone(0.5, "a"), req(0.6, "a")], pol, s)
    s, _ = run([MemberGone(1.0, "a", "left"), req(1.5, "a")], pol, s)
    assert slot_of(s, "a").round is None  # queued for the next round


def test_a_follower_lost_in_window_or_push_ends_the_round_at_once():
    pol = policy(window_s=5.0, push_timeout_s=60.0)
    for lose_at, phase in ((1.0, Phase.WINDOW), (6.0, Phase.PUSH)):
        s, _ = run([req(0.0, "a"), req(0.5, "b")], pol)
        s, _ = run([PushReported(0.9, "a", s.current.slots["a"].push_id, True)], pol, s)
        if phase is Phase.PUSH:
            s, _ = run([Tick(5.0)], pol, s)
        assert s.phase is phase
        s, acts = run([ReadyChanged(lose_at, False, "follower 1 down")], pol, s)
        assert kinds(acts)[-1] == "StartUpdate" and s.phase is Phase.UPDATE
        assert {x.cluster_id: (x.ok, x.error) for x in acts[-1].slots} == {
            "a": (False, "follower 1 down"), "b": (False, "follower 1 down")}
        assert {x.code for x in acts[-1].slots} == {"followers_not_ready"}  # typed, not text
        assert s.current.update_started == lose_at  # not the 60 s push timeout


def test_push_deadline_follows_measured_push_times():
    pol = policy(window_s=1.0, push_timeout_s=60.0)  # floor 2 s, slack 4
    s, _ = run([req(0.0, "a", tokens=5), Tick(1.0)], pol)
    assert s.current.push_deadline == 61.0  # nothing measured: the timeout
    s, _ = run([PushReported(0.5, "a", s.current.slots["a"].push_id, True)], pol, s)
    assert s.push_s == {}  # measured once scored complete (review 14, F2)
    s, _ = run([UpdateFinished(1.2, 1, UpdateOutcome(1, ("a",)))], pol, s)
    assert s.push_s == {"a": 0.5}
    s, _ = run([req(10.0, "a")], pol, s)
    assert s.current.slots["a"].expected_s == 0.5
    s, acts = run([Tick(11.0)], pol, s)
    assert s.current.push_deadline == 10.0 + 2.0 + 4 * 0.5  # admitted at 10
    s, acts = run([PushReported(11.5, "a", s.current.slots["a"].push_id, True),
                   UpdateFinished(11.6, 2, UpdateOutcome(2, ("a",)))], pol, s)
    assert s.push_s["a"] == pytest.approx(0.5 * 1.5 + 0.5 * 0.5)  # EMA, alpha 0.5
    # A member's own prediction serves only until the leader measured it.
    s2, _ = run([PushRequested(0.0, "z", "pz", 0, 5, expected_s=3.0), Tick(1.0)], pol)
    assert s2.current.push_deadline == 0.0 + 2.0 + 4 * 3.0
    # A member without any prediction keeps the round at the timeout.
    s3, _ = run([PushRequested(0.0, "z", "pz", 0, 5, expected_s=3.0), req(0.5, "y"),
                 Tick(1.0)], pol)
    assert s3.current.push_deadline == 61.0


def test_push_deadline_never_exceeds_the_timeout_and_is_off_with_infinite_slack():
    s, _ = run([PushRequested(0.0, "z", "pz", 0, 5, expected_s=100.0), Tick(1.0)],
               policy(window_s=1.0, push_timeout_s=30.0))
    assert s.current.push_deadline == 31.0
    pol = replace(policy(window_s=1.0, push_timeout_s=math.inf), push_slack=math.inf)
    s, _ = run([PushRequested(0.0, "z", "pz", 0, 5, expected_s=0.1), Tick(1.0)], pol)
    assert s.current.push_deadline == math.inf


def test_a_member_gone_before_the_update_is_dropped_even_if_delivered():
    pol = policy(window_s=0.0)
    s, _ = run([req(0.0, "a"), req(0.0, "b"), Tick(0.0)], pol)
    s, _ = run([PushReported(0.5, "a", s.current.slots["a"].push_id, True)], pol, s)
    s, acts = run([MemberGone(0.6, "a", "left"), PushReported(0.7, "b", s.current.slots["b"].push_id, True)],
                  pol, s)
    slots = {x.cluster_id: x for x in acts[-1].slots}
    assert not slots["a"].ok and slots["a"].error == "left" and slots["b"].ok
    # In the update phase it is too late: the slot stays as delivered (the caller credits it).
    s2, _ = run([req(1.0, "c"), Tick(1.0)], pol, RoundState())
    s2, _ = run([PushReported(1.1, "c", s2.current.slots["c"].push_id, True)], pol, s2)
    assert s2.phase is Phase.UPDATE
    s2, _ = run([MemberGone(1.2, "c", "left")], pol, s2)
    assert s2.current.slots["c"].ok and s2.current.slots["c"].pulled


def test_a_hopeless_push_travels_ahead_and_joins_a_round_once_it_arrived():
    pol = policy(window_s=1.0)  # stage_ratio 4, stage_min_s 1 s
    s = RoundState()
    # a and b push in 0.1 s; c's link is slow: it predicts 10 s.
    for k, c in enumerate("ab"):
        s, _ = run([req(10.0 * k, c), Tick(10.0 * k + 1)], pol, s)
        s, _ = run([PushReported(10.0 * k + 0.1, c, s.current.slots[c].push_id, True),
                    UpdateFinished(10.0 * k + 1.2, k + 1, UpdateOutcome(k + 1, (c,)))], pol, s)
    assert s.push_s == pytest.approx({"a": 0.1, "b": 0.1})
    s, acts = run([req(30.0, "a"), PushRequested(30.2, "c", "pc", 2, 50, expected_s=10.0)], pol, s)
    assert kinds(acts) == ["RoundOpened", "Admitted", "Staged"]
    assert s.staging["c"].push_id == "pc" and "c" not in s.current.slots
    with pytest.raises(Refused):  # still in flight
        step(s, req(30.3, "c"), pol)
    # The round of a goes on without waiting for c's transfer.
    s, acts = run([Tick(31.0), PushReported(31.1, "a", s.current.slots["a"].push_id, True)], pol, s)
    assert kinds(acts) == ["WindowClosed", "StartUpdate"]
    assert [x.cluster_id for x in acts[-1].slots] == ["a"]
    s, _ = run([UpdateFinished(31.5, 3, UpdateOutcome(3, ("a",)))], pol, s)
    # c's push arrives 10 s later: it opens a round of its own, already delivered.
    s, acts = run([PushReported(40.2, "c", "pc", True)], pol, s)
    assert kinds(acts) == ["RoundOpened", "Admitted"] and acts[1].slot.done and acts[1].slot.ok
    assert s.staging == {}
    s, acts = run([Tick(41.2)], pol, s)
    assert kinds(acts) == ["WindowClosed", "StartUpdate"]  # nothing to wait for
    s, _ = run([UpdateFinished(41.5, 4, UpdateOutcome(4, ("c",)))], pol, s)
    assert s.push_s["c"] == pytest.approx(10.0)  # measured from when it was sent ahead
    # A member never measured, or alone, is not sent ahead; nor a push under stage_min_s.
    assert not hopeless(RoundState(), "c", 10.0, pol)
    typical = sorted(v for k, v in s.push_s.items() if k != "c")[1]  # a: 0.6, b: 0.1
    assert not hopeless(s, "c", 0.9, pol) and not hopeless(s, "c", 4 * typical, pol)
    assert hopeless(s, "c", 4 * typical + 0.01, pol)



def _stall_then_report_empty(pol, cycles):
    """Review 14, F2: a member stalls a round (admitted, never reports), then reports each push
    sent ahead of its round as delivered at once with no data; the update finds it incomplete.
    Returns the state after at most ``cycles`` such reports (fewer if a push of the member is
    admitted into a round again) and every action since the stall."""
    s, out = RoundState(), []
    for k, c in enumerate("ab"):  # honest a and b push in 0.1 s
        s, _ = run([req(10.0 * k, c), Tick(10.0 * k + 1)], pol, s)
        s, _ = run([PushReported(10.0 * k + 0.1, c, s.current.slots[c].push_id, True),
                    UpdateFinished(10.0 * k + 1.2, k + 1, UpdateOutcome(k + 1, (c,)))], pol, s)
    s, acts = run([req(30.0, "a"), req(30.0, "h"), Tick(30.5)], pol, s)
    assert {a.slot.cluster_id for a in acts if isinstance(a, Admitted)} == {"a", "h"}
    s, _ = run([PushReported(30.1, "a", s.current.slots["a"].push_id, True), Tick(31.0)], pol, s)
    s, _ = run([Tick(s.current.push_deadline)], pol, s)  # h never reports
    s, _ = run([UpdateFinished(32.5, 3, UpdateOutcome(3, ("a",)))], pol, s)
    number, now = 3, 40.0
    for _ in range(cycles):
        s, acts = run([PushRequested(now, "h", f"h{now}", 0, 5, expected_s=0.0)], pol, s)
        out += acts
        if "h" not in s.staging:  # admitted into a round: the stall could begin again
            return s, out
        number += 1
        s, acts = run([PushReported(now, "h", f"h{now}", True), Tick(now + 1.0),
                       UpdateFinished(now + 1.1, number, UpdateOutcome(
                           3, (), invalid={"h": "follower 0: layers missing"}))], pol, s)
        out += acts
        now += 10.0
    return s, out


def test_a_push_reported_delivered_but_incomplete_keeps_its_member_sent_ahead():
    """Review 14, F2: two fast dataless reports brought a stalling member's estimate under
    1 s and it stalled the next round again. A push counts as fast only once scored complete:
    its incomplete pushes never lower the estimate and keep its pushes sent ahead."""
    pol = policy(window_s=1.0)  # floor 2 s, slack 4, stage_ratio 4, stage_min_s 1 s
    s, out = _stall_then_report_empty(pol, cycles=6)
    staged = [a.slot.push_id for a in out if type(a).__name__ == "Staged"]
    assert staged == [f"h{40.0 + 10 * k}" for k in range(6)]  # never admitted into a round
    held = s.push_s["h"]
    assert held == pytest.approx(2.4)  # admitted at 30 s, timed out at 30 + 2 + 4 × 0.1
    assert not any(isinstance(a, Admitted) and a.slot.cluster_id == "h" and not a.slot.done
                   for a in out)
    verdicts = [v for a in out if isinstance(a, Decided) for v in a.verdicts]
    assert [(v.cluster_id, v.accepted) for v in verdicts] == [("h", False)] * 6
    # 7 incomplete pushes (the stall and 6 empty reports): it owes 2**6 = 64 complete ones.
    assert s.stalls["h"] == 7 and s.send_ahead["h"] == MAX_OWED == 64
    # Pushes delivered complete pay it off and bring the estimate down (measured from when
    # each was sent ahead); once paid and fast again, its push is admitted into a round.
    now = 100.0
    for k in range(64):
        s, acts = run([PushRequested(now, "h", f"hc{k}", 0, 5),
                       PushReported(now + 0.3, "h", f"hc{k}", True), Tick(now + 1.3),
                       UpdateFinished(now + 1.4, 10 + k, UpdateOutcome(4 + k, ("h",)))], pol, s)
        assert type(acts[0]).__name__ == "Staged"
        assert ("h" in s.send_ahead) == (k < 63) and s.send_ahead.get("h", 0) == 63 - k
        assert [v.accepted for a in acts if isinstance(a, Decided) for v in a.verdicts] == [True]
        now += 10.0
    # While it owed, the estimate never dropped (review 18, B); paid off, pushes sent ahead
    # for its estimate (2.4 s against the others' 0.1 s) bring it down, and once it is under
    # stage_min_s (1 s) its push is admitted into a round again.
    assert s.push_s["h"] == pytest.approx(held)
    for k in range(2):
        s, acts = run([PushRequested(now, "h", f"hf{k}", 0, 5),
                       PushReported(now + 0.3, "h", f"hf{k}", True), Tick(now + 1.3),
                       UpdateFinished(now + 1.4, 74 + k, UpdateOutcome(68 + k, ("h",)))], pol, s)
        assert type(acts[0]).__name__ == "Staged" and "h" not in s.send_ahead
        now += 10.0
    assert s.push_s["h"] == pytest.approx(0.25 * held + 0.75 * 0.3)
    s, acts = run([PushRequested(now, "h", "hn", 5, 5)], pol, s)
    assert "h" not in s.staging and s.current.slots["h"].push_id == "hn"


@pytest.mark.parametrize("how", ["silent", "late", "threshold"])
def test_a_member_that_stalls_each_round_it_is_admitted_to_owes_twice_as_much_each_time(how):
    """Review 17, C: a member sent its pushes ahead complete at once, was measured fast again,
    and stalled the next round it was admitted to (it sent nothing), round after round: honest
    throughput 0.61×. Review 18, B: the same with complete pushes reported just before their
    deadline (0.59×). What it owes doubles with each stall, so in 100 of its pushes it holds
    7 rounds (after 1, 2, 4, ... complete pushes), not one in every two or three."""
    pol = policy(window_s=1.0)
    s, _ = run([req(0.0, "a"), Tick(1.0)], pol)  # an honest member whose pushes take 0.1 s
    s, _ = run([PushReported(1.1, "a", s.current.slots["a"].push_id, True),
                UpdateFinished(1.2, 1, UpdateOutcome(1, ("a",)))], pol, s)
    now, held = 100.0, 0
    for k in range(100):
        s, acts = run([PushRequested(now, "h", f"h{k}", 0, 5, expected_s=0.1)], pol, s)
        if "h" in s.staging:  # sent ahead: it delivers at once, complete
            s, _ = run([PushReported(now + 0.1, "h", f"h{k}", True), Tick(now + 1.1)], pol, s)
            s, _ = run([UpdateFinished(now + 1.2, s.rounds, UpdateOutcome(k, ("h",)))], pol, s)
        else:  # admitted into a round: it holds it to the push deadline
            held += 1
            s, _ = run([Tick(now + 1.0)], pol, s)
            due = s.current.push_deadline
            if how == "silent":  # and fails
                s, _ = run([Tick(due)], pol, s)
                outcome = UpdateOutcome(k)
            else:  # complete, just before the deadline, or just under a lateness threshold
                # of its own estimate (review 19, B′: 0.76×)
                slot = s.current.slots["h"]
                at = (due - 0.4 if how == "late" else
                      slot.admitted_at + pol.push_floor_s / 2 + 2 * slot.expected_s - 0.4)
                s, _ = run([PushReported(at, "h", f"h{k}", True)], pol, s)
                outcome = UpdateOutcome(k, ("h",))
            s, _ = run([UpdateFinished(due + 0.1, s.rounds, outcome)], pol, s)
        now += 100.0
    assert held <= 9 and s.stalls["h"] >= held - 2  # about log2 of its pushes


def test_a_failed_or_abandoned_push_counts_like_a_timeout_but_not_one_its_round_failed():
    """Review 14, F2: a push not delivered complete never lowers its member's estimate and
    sends the member's pushes ahead; a push failed by its round (followers lost) or in a round
    that failed as a whole before it was scored says nothing of its member's link."""
    pol = policy(window_s=1.0)
    base, _ = run([req(0.0, "a"), Tick(1.0)], pol)
    base, _ = run([PushReported(1.5, "a", base.current.slots["a"].push_id, True),
                   UpdateFinished(1.6, 1, UpdateOutcome(1, ("a",)))], pol, base)
    assert base.push_s == {"a": 1.5} and base.send_ahead == {}
    opened, _ = run([req(10.0, "a"), Tick(11.0)], pol, base)
    pid = opened.current.slots["a"].push_id
    # reported failed at once, left mid-push, or reported delivered but refused by a follower
    for events, outcome in (
            ([PushReported(11.1, "a", pid, False, "link down")], UpdateOutcome(1)),
            ([MemberGone(11.1, "a", "left")], UpdateOutcome(1)),
            ([PushReported(11.1, "a", pid, True)],
             UpdateOutcome(1, invalid={"a": "follower 0: layers missing"}))):
        s, _ = run([*events, UpdateFinished(11.2, 2, outcome)], pol, opened)
        assert s.send_ahead == {"a": 1} and s.push_s == {"a": 1.5}, events
        s, acts = run([req(20.0, "a")], pol, s)
        assert kinds(acts) == ["Staged"]  # alone, so not for its estimate
    # not the member's doing: nothing changes
    for events, outcome in (
            ([ReadyChanged(11.1, False, "follower 0 down")], UpdateOutcome(1)),
            ([PushReported(11.1, "a", pid, True)], UpdateOutcome(1, error="round failed: x"))):
        s, _ = run([*events, UpdateFinished(11.2, 2, outcome)], pol, opened)
        assert s.send_ahead == {} and s.push_s == {"a": 1.5}, events
    # a complete push moves the estimate either way
    for at, took in ((13.0, 3.0), (11.2, 1.2)):
        s, _ = run([PushReported(at, "a", pid, True),
                    UpdateFinished(at + 0.1, 2, UpdateOutcome(2, ("a",)))], pol, opened)
        assert s.push_s["a"] == pytest.approx(0.5 * took + 0.5 * 1.5)


def test_a_member_without_a_prediction_gets_the_median_push_not_the_slowest():
    """Review 18, C: a colluder made its own pushes look slow (7.5 s); a fresh identity with
    no prediction of its own was then given 2 s + 4 × 7.5 s to stall its first round. It gets
    the median measured push instead (the upper one)."""
    from dips.algo.round import Round, Slot, push_deadline

    pol = policy(window_s=1.0)
    fresh = Slot("new", "p-new", 0, 5, 10.0, None, round=3, admitted_at=10.0)
    rnd = Round(3, 10.0, 11.0, {"new": fresh})
    measured = {"a": 0.1, "b": 0.2, "x": 7.5}
    assert push_deadline(rnd, 11.0, pol, measured) == pytest.approx(10.0 + 2.0 + 4 * 0.2)
    assert push_deadline(rnd, 11.0, pol, {}) == 11.0 + pol.push_timeout_s  # nothing measured
