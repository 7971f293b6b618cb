"""The faults of the last hour and the heartbeat ages in ``GetStatus`` and ``dips status``
(issue 15): a real leader (a fake follower, the test's clock) records a member removed by its
monitor, rejected pushes and a rollback through its own writers; the reply carries them
newest first with counts by kind and reason, the members' heartbeat ages on the leader's
clock, and a restarted leader reads the last hour back from the tails of its files (not an
older fault) and adds its own restart. Waits are for events (wait_for), never durations."""

from __future__ import annotations

import json
import time

import pytest
from rich.console import Console

from dips.node.status import snapshot
from dips.node.status_cli import render
from dips.roles.leader_faults import tail_records
from dips.wire.status_msg import FAULTS_LISTED, status_reply
from tests.roles.test_hostile_leader import ManualClock, make_leader, wait_for

pytestmark = pytest.mark.timeout(120)


def reply_of(leader):
    return status_reply(leader.status(), leader.last_eval(), leader.recent_faults(time.time()))


_CODES = {"penalty": "penalty", "push not delivered in time": "not_delivered"}


def decision(rnd: int, rejected: dict[str, str]) -> dict:
    return {"round": rnd, "version": 1, "clusters": ["b", *rejected], "accepted": ["b"],
            "rejected": {c: {"score": 1.0, "reason": r, "code": _CODES[r]}
                         for c, r in rejected.items()},
            "tokens": {"b": 64, **{c: 64 for c in rejected}}, "time": time.time()}


def test_the_leaders_faults_and_heartbeat_ages_reach_dips_status(tmp_path):
    old = time.time() - 2 * 3600.0  # a fault of two hours ago, before this leader started
    (tmp_path / "leader_events.jsonl").write_text(json.dumps(
        {"time": old, "event": "cluster_removed", "cluster": "z", "silent_s": 9.0}) + "\n")
    clock = ManualClock()
    leader, _ = make_leader(tmp_path, clock=clock)
    try:
        leader.join_cluster("a", [["l0", "l1"]])
        leader.join_cluster("b", [["l0", "l1"]])  # (no join while a follower is down)
        clock.advance(30.0)
        leader.heartbeat("b", 1, 64, 5.0)
        clock.advance(31.0)  # 60 missed heartbeats of 1 s: the monitor removes a (and marks
        # (the fake follower, silent too, is marked down): wait for the records, which are
        # written after the member dicts change
        wait_for(lambda: {f.kind for f in reply_of(leader).faults} >= {"cluster_removed",
                                                                       "follower_down"},
                 "cluster a removed and follower 0 down, recorded")
        leader._write(decision(7, {"c": "penalty", "d": "push not delivered in time"}))
        leader.event("reconciled", version=0, lost=1, changed=True, windows_lost=0)
        clock.advance(2.5)
        reply = reply_of(leader)
        assert reply.fault_window_s == 3600.0
        got = [(f.kind, f.member, f.reason) for f in reply.faults]  # newest first
        assert got[:3] == [("rollback", "leader", ""), ("push_rejected", "cluster-c", "penalty"),
                           ("push_rejected", "cluster-d", "not_delivered")]
        assert set(got[3:]) == {("cluster_removed", "cluster-a", "heartbeat_timeout"),
                                ("follower_down", "follower-0", "heartbeat_timeout")}
        assert {(c.kind, c.reason): c.count for c in reply.fault_counts} == {
            ("cluster_removed", "heartbeat_timeout"): 1, ("follower_down", "heartbeat_timeout"): 1,
            ("push_rejected", "penalty"): 1, ("push_rejected", "not_delivered"): 1,
            ("rollback", ""): 1}
        assert [(c.cluster_id, c.heartbeat_age_s) for c in reply.clusters] == [("b", 33.5)]
        assert [(h.index, h.up, h.heartbeat_age_s) for h in reply.follower_health] == \
            [(0, False, 63.5)]  # registered at the start; the fake follower never heartbeats

        doc = snapshot(reply, "l:1", time.time())
        assert doc["clusters"][0]["heartbeat_age_s"] == 33.5 and doc["fault_window_s"] == 3600
        assert doc["faults"][0]["detail"] == "1 outer steps lost, back to version 0"
        assert json.loads(json.dumps(doc, allow_nan=False)) == doc
        console = Console(record=True, width=240, color_system=None)
        console.print(render(doc))
        text = console.export_text()
        assert ("faults in the last 60 min: 1 cluster_removed (heartbeat_timeout 1), "
                "1 follower_down (heartbeat_timeout 1), 2 push_rejected (not_delivered 1, "
                "penalty 1), 1 rollback") in text
        assert "33.5 s" in text and "63.5 s" in text and "cluster-z" not in text
    finally:
        leader.stop()

    # A restarted leader: the last hour read back from its files, and its own restart.
    leader, _ = make_leader(tmp_path, clock=ManualClock())
    try:
        faults = leader.recent_faults(time.time())[0]
        assert [f.kind for f in faults][:4] == ["leader_restarted", "rollback", "push_rejected",
                                                "push_rejected"]
        assert {f.kind for f in faults[4:]} == {"cluster_removed", "follower_down"}
        assert all(f.member != "cluster-z" for f in faults)  # two hours old: not in the window
    finally:
        leader.stop()


def test_the_tail_is_read_backwards_only_as_far_as_the_window(tmp_path):
    path = tmp_path / "leader_events.jsonl"
    lines = [json.dumps({"time": float(t), "event": "x", "pad": "y" * 50}) for t in range(400)]
    path.write_text("\n".join(lines) + "\n" + "not json\n" + '{"time": 399.5, "ev')  # cut
    for block in (64, 1000, 1 << 16):
        got = tail_records(path, since=390.0, block=block)
        assert [r["time"] for r in got] == [float(t) for t in range(390, 400)], block
    assert len(tail_records(path, since=-1.0, block=97)) == 400
    assert tail_records(tmp_path / "missing.jsonl", 0.0) == []
    assert FAULTS_LISTED == 50
