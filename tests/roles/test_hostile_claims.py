"""A member's claims that once scaled every member's step (review 20 of issue 13).

* **Base version.** The §8 staleness scale 1/(1 + Σ w_j s_j) shrinks the whole round's step,
  and s_j = version − base_version was the member's own claim: one member claiming base 0
  at version 1,000 cut the others' progress to 0.003×. The leader now counts staleness from
  no lower than the version the member was given (:func:`dips.algo.limits.push_base_version`).
* **Join floods.** Each join re-keys the member and writes an event: 1,489 joins/s from one
  member grew the leader's event log by 13 GB a day. Joins in a row now back off
  (:func:`dips.algo.limits.join_allowed`).
* **Token weight × push radius.** A member may be credited up to ``max_push_tokens`` (4 sync
  intervals), and the push-norm radius lets a push in at 2·√μ: the two multiplied to 8× an
  honest member's leverage, and one sign-flipped member of up to nine reversed training. A push
  now weighs at most one sync interval's tokens (``push_tokens_weighed``).
"""

from __future__ import annotations

import json
import threading

import pytest

from dips.algo.limits import JOIN_BURST, join_allowed, push_base_version
from dips.algo.refusal import Refusal, Refused
from dips.roles.leader import Leader
from dips.spec import RunConfig
from dips.spec.run import PUSH_TOKENS_SLACK, LeaderConfig
from tests.roles.test_hostile_leader import TPW, ManualClock, make_leader, member, ticket_of

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("claimed, floor, version, believed", [
    (0, 40, 41, 40),    # a claim below what it was given: raised to the floor
    (41, 40, 41, 41),   # a fresher claim is believed (it only lowers its own penalty)
    (40, 40, 41, 40),   # the honest claim
    (3, 40, 30, 30),    # after a rollback to 30 the floor is cut to the version
])
def test_the_base_version_is_raised_to_what_the_member_was_given(claimed, floor, version,
                                                                   believed):
    assert push_base_version(claimed, floor, version) == believed


def _round(leader: Leader, clock: ManualClock, pushes: dict[str, tuple[int, dict[int, int]]]):
    """One round of ``pushes`` (cluster -> (claimed base version, progress)); every member
    reports its pull. Returns the verdict replies by cluster."""
    grants = {c: leader.request_push(c, base, TPW, 5.0, progress)
              for c, (base, progress) in pushes.items()}
    assert len({g.round for g in grants.values()}) == 1  # the clock stands: one window
    clock.advance(5.0)
    replies: dict = {}
    threads = [threading.Thread(target=lambda c=c, g=g: replies.__setitem__(
        c, leader.push_done(c, g.push_id, True, "", 30.0)), daemon=True)
        for c, g in grants.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for c, reply in replies.items():
        leader.pull_done(c, reply.verdict.version)
    return replies


def _decisions(tmp_path) -> list[dict]:
    lines = (tmp_path / "outer_steps.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "base_versions" in r]


def _after_rounds(tmp_path, ids, rounds):
    """A leader on a manual clock whose members ``ids`` completed ``rounds`` honest rounds."""
    clock = ManualClock()
    leader, _ = make_leader(tmp_path, clock=clock, window_s=5.0)
    pos = {c: member(leader, c) for c in ids}
    for k in range(1, rounds + 1):
        _round(leader, clock, {c: (leader.version, {min(p): k}) for c, p in pos.items()})
    assert leader.version == rounds
    return leader, clock, pos


def test_a_member_claiming_base_version_zero_is_counted_from_the_version_it_was_given(tmp_path):
    leader, clock, pos = _after_rounds(tmp_path, ("a", "h"), 5)
    try:
        # h claims it trained from version 0; it was told to pull version 5 (and said it did).
        _round(leader, clock, {"a": (5, {min(pos["a"]): 6}), "h": (0, {min(pos["h"]): 6})})
        last = _decisions(tmp_path)[-1]
        assert last["base_versions"] == {"a": 5, "h": 5}  # not {"h": 0}: staleness 0, not 5
        # A member that never reports its pulls is still held to the verdicts' versions.
        _round(leader, clock, {"a": (6, {min(pos["a"]): 7}), "h": (6, {min(pos["h"]): 7})})
        leader.clusters["h"].pulled_version = -1
        _round(leader, clock, {"a": (7, {min(pos["a"]): 8}), "h": (1, {min(pos["h"]): 8})})
        assert _decisions(tmp_path)[-1]["base_versions"]["h"] == 7
    finally:
        leader.stop()
    # The floors survive a restart of the leader (leader.json; the new fake follower holds
    # version 0, so the leader then reconciles down to it: push_base_version cuts the floor).
    assert json.loads((tmp_path / "leader.json").read_text())["floor_versions"] == {"a": 8,
                                                                                  "h": 8}
    again, _ = make_leader(tmp_path)
    try:
        assert again.clusters["h"].floor_version == 8
    finally:
        again.stop()


def test_a_rejoined_member_starts_from_the_version_it_joined_at(tmp_path):
    leader, _, _ = _after_rounds(tmp_path, ("a", "b"), 3)
    try:
        late = member(leader, "late")
        assert leader.clusters["late"].floor_version == 3
        grant = leader.request_push("late", 0, TPW, 5.0, {min(late): 1})
        assert ticket_of(leader, grant).base_version == 3
    finally:
        leader.stop()


def test_a_member_credited_four_intervals_weighs_one(tmp_path):
    """Review 20, S: h reports four sync intervals of windows (all credited by the ledger, up
    to max_push_tokens) and weighs as much as a, which trained one."""
    clock = ManualClock()
    leader, fake = make_leader(tmp_path, clock=clock, window_s=5.0,
                               max_push_tokens=4 * TPW, push_tokens_weighed=TPW)
    try:
        pa, ph = member(leader, "a"), member(leader, "h")
        replies = _round(leader, clock, {"a": (0, {min(pa): 1}), "h": (0, {min(ph): 4})})
        assert all(r.verdict.accepted for r in replies.values())
        assert fake.applied == [(1, ["a", "h"], [0.5, 0.5])]  # not [0.2, 0.8]
        assert leader.counts["tokens_accepted"] == 5 * TPW  # the data is still accounted
    finally:
        leader.stop()


def test_a_run_config_weighs_one_sync_interval_and_credits_the_slack():
    cfg = RunConfig()
    inner = cfg.inner
    leader_cfg = LeaderConfig.from_run(cfg)
    interval = inner.H * inner.batch_size * inner.seq_len
    assert leader_cfg.push_tokens_weighed == interval
    assert leader_cfg.max_push_tokens == PUSH_TOKENS_SLACK * interval


def test_joins_in_a_row_back_off_and_a_quiet_cluster_starts_afresh():
    history, t = None, 100.0
    for k in range(JOIN_BURST + 1):  # the first join, then re-joins at once (a failed pull)
        wait, history = join_allowed(history, t, 1.0, 300.0)
        assert wait == 0.0 and history == (t, k)
    assert join_allowed(history, t + 0.25, 1.0, 300.0) == (0.75, history)  # unchanged
    waits = []
    for _ in range(12):  # then 1, 2, 4, ... s, at most 300 s
        needed = join_allowed(history, history[0], 1.0, 300.0)[0]
        waits.append(needed)
        history = join_allowed(history, history[0] + needed, 1.0, 300.0)[1]
    assert waits == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300]
    # A join 600 s or more after the one before (a crash now and then) starts afresh.
    assert join_allowed(history, history[0] + 600.0, 1.0, 300.0) == (0.0,
                                                                     (history[0] + 600.0, 0))


def test_a_join_flood_is_refused_busy_and_writes_nothing(tmp_path):
    clock = ManualClock()
    leader, _ = make_leader(tmp_path, clock=clock)
    try:
        for _ in range(JOIN_BURST + 1):
            leader.join_cluster("h", [["l0", "l1"]])
        events = (tmp_path / "leader_events.jsonl").read_text()
        with pytest.raises(Refused) as info:
            leader.join_cluster("h", [["l0", "l1"]])
        assert info.value.code is Refusal.BUSY and "rejoin_min_s" in info.value.message
        assert (tmp_path / "leader_events.jsonl").read_text() == events
        assert "h" in leader.clusters  # the refusal changes nothing
        leader.join_cluster("a", [["l0", "l1"]])  # another member joins as it likes
        clock.advance(1.0)
        leader.join_cluster("h", [["l0", "l1"]])
    finally:
        leader.stop()
