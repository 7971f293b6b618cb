"""A lease without progress does not block the others (issue 13; review 14, F3; §12 of the seed:
data is pre-split into many more chunks than clusters so that a dynamic set of clusters gets
balanced data). A member with valid credentials leased its cap and then only sent heartbeats;
once the others had finished every other chunk, no epoch could begin and the run stopped
until the hoarder was removed. Now, once no chunk is free, a member that asks gets the chunks
of a holder whose accepted position stood still for ``lease_timeout_s`` seconds."""

from __future__ import annotations

import json

import pytest

from dips.algo.refusal import Refusal
from dips.roles.leader import LeaderConfig
from dips.spec import RunConfig
from tests.roles.test_hostile_leader import (
    TPW,
    ManualClock,
    make_leader,
    refused,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)
IDLE_S = 30.0


def push(leader, cid: str, progress: dict[int, int]) -> list[tuple[int, int]]:
    """One accepted push of ``cid`` reporting ``progress``; returns its verdict's holdings."""
    grant = leader.request_push(cid, leader.version, 10 * TPW, 5.0, progress)
    done = leader.push_done(cid, grant.push_id, True, "", 30.0)
    assert done.verdict.accepted, done
    wait_for(lambda: leader.phase == "idle", "round ended")
    return list(done.holdings)


def beat(leader, *cids: str) -> None:
    for cid in cids:
        assert leader.heartbeat(cid, 0, 0, None).known


def test_an_honest_member_gets_the_hoarders_chunks_and_the_epoch_rolls(tmp_path):
    clock = ManualClock()
    leader, _ = make_leader(tmp_path, clock=clock, lease_ahead=2, max_push_tokens=10 * TPW,
                            lease_timeout_s=IDLE_S)  # 8 chunks of 10 windows; a cap of 4
    try:
        for cid in ("h", "a", "b"):
            leader.join_cluster(cid, [["l0", "l1"]])
        hoard = [c for c, _ in leader.lease("h", 2**31 - 1)[0]]
        assert len(hoard) == 4                              # its cap, then only heartbeats
        for cid in ("a", "b"):
            for chunk, _ in leader.lease(cid, 2)[0]:
                push(leader, cid, {chunk: 10})
        assert leader.ledger.summary() == {"epoch": 0, "accepted_windows": 40, "finished": 4,
                                           "held": 4, "free": 0}
        clock.advance(IDLE_S)
        beat(leader, "h", "a", "b")
        assert leader.lease("a", 2)[0] == []                # not idle for longer yet: it waits
        clock.advance(1.0)
        beat(leader, "h", "a", "b")
        assert leader.lease("a", 2)[0] == [(hoard[0], 0), (hoard[1], 0)]
        assert "held by 'a'" in refused(lambda: leader.request_push("h", 0, TPW, 5.0,
                                                                    {hoard[0]: 1}),
                                        Refusal.LEDGER_CONFLICT)
        assert [c for c, _ in leader.lease("h", 0)[0]] == hoard[2:]  # its client re-syncs
        assert leader.lease("b", 2)[0] == [(hoard[2], 0), (hoard[3], 0)]
        for cid in ("a", "b"):
            for chunk, _ in leader.lease(cid, 0)[0]:
                push(leader, cid, {chunk: 10})
        assert leader.lease("a", 2)[0] == [(0, 0), (1, 0)]  # every chunk finished: epoch 1
        assert leader.ledger.epoch == 1 and leader.ledger.accepted_windows == 80
        assert leader.counts["tokens_accepted"] == 80 * TPW
        leader.ledger.check()
    finally:
        leader.stop()
    events = [json.loads(line) for line in (tmp_path / "leader_events.jsonl").open()]
    moved = [e for e in events if e["event"] == "chunks_reassigned"]
    assert [(e["cluster"], e["idle_holder"], e["chunks"]) for e in moved] == [
        ("a", "h", hoard[:2]), ("b", "h", hoard[2:])]


def test_a_member_whose_pushes_are_accepted_keeps_its_chunks(tmp_path):
    """The honest but slow cluster at an epoch's end: it is not robbed while it advances."""
    clock = ManualClock()
    leader, _ = make_leader(tmp_path, clock=clock, lease_ahead=2, max_push_tokens=10 * TPW,
                            lease_timeout_s=IDLE_S)
    try:
        for cid in ("s", "a"):
            leader.join_cluster(cid, [["l0", "l1"]])
        slow = [c for c, _ in leader.lease("s", 4)[0]]
        for chunk, _ in leader.lease("a", 4)[0]:
            push(leader, "a", {chunk: 10})
        for done in (3, 6, 9):                               # an accepted push every 20 s
            clock.advance(20.0)
            push(leader, "s", {slow[0]: done})
            beat(leader, "s", "a")
            assert leader.lease("a", 2)[0] == []
        clock.advance(IDLE_S + 1)                            # then it stands still:
        beat(leader, "s", "a")
        assert leader.lease("a", 2)[0] == []                 # under 3 of its 20 s intervals
        clock.advance(30.0)
        beat(leader, "s", "a")
        assert leader.lease("a", 2)[0] == [(slow[0], 9), (slow[1], 0)]  # part-done first
    finally:
        leader.stop()


def test_the_bound_is_the_run_configs_data_lease_timeout_s():
    assert LeaderConfig.from_run(RunConfig()).lease_timeout_s == RunConfig().data.lease_timeout_s
    assert LeaderConfig().lease_timeout_s is None            # a bare leader never reassigns
