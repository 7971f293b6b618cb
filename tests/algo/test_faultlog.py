"""The leader's faults of the last hour (issue 15, dips.algo.faultlog): which records report
which faults, the window and counts, the bound on memory, and bad arguments by name."""

from __future__ import annotations

import pytest

from dips.algo.faultlog import Fault, FaultLog, faults_of, reason_class

DECISION = {"round": 4, "version": 3, "clusters": ["a", "b", "c"], "accepted": ["a"],
            "rejected": {"b": {"score": 9.5, "reason": "penalty", "code": "penalty"},
                         "c": {"score": None, "reason": "push not delivered in time",
                               "code": "not_delivered"}},
            "time": 1000.0}


def kinds(stream: str, rec: dict) -> list[tuple[str, str, str]]:
    return [(f.kind, f.member, f.reason) for f in faults_of(stream, rec)]


def test_each_record_reports_its_faults_by_kind_member_and_reason():
    assert kinds("outer_steps", DECISION) == [("push_rejected", "cluster-b", "penalty"),
                                              ("push_rejected", "cluster-c", "not_delivered")]
    failed = {**DECISION, "accepted": [], "error": "round failed: UNAVAILABLE",
              "rejected": {"a": {"reason": "round failed: UNAVAILABLE", "code": "round_failed"}}}
    assert kinds("outer_steps", failed) == [("push_rejected", "cluster-a", "round_failed")]
    assert kinds("outer_steps", {"event": "round_end", "round": 4, "commit_failed": [1],
                                 "time": 5.0}) == [("commit_failed", "follower-1", "")]
    assert kinds("outer_steps", {"event": "rollback", "version": 2, "time": 5.0}) == []
    ev = "leader_events"
    assert kinds(ev, {"event": "cluster_removed", "cluster": "a", "silent_s": 3.2,
                      "time": 1.0}) == [("cluster_removed", "cluster-a", "heartbeat_timeout")]
    assert kinds(ev, {"event": "cluster_removed", "cluster": "a", "base_version": 9,
                      "version": 3, "time": 1.0}) == [
        ("cluster_removed", "cluster-a", "base_version_ahead")]
    assert kinds(ev, {"event": "follower_down", "follower": 1, "silent_s": 3.0, "time": 1.0}) \
        == [("follower_down", "follower-1", "heartbeat_timeout")]
    assert kinds(ev, {"event": "follower_down", "follower": 0, "cause": "data plane",
                      "error": "bind", "time": 1.0}) == [("follower_down", "follower-0",
                                                          "data_plane")]
    assert kinds(ev, {"event": "follower_up", "follower": 0, "restarted": True,
                      "incarnation": 7, "time": 1.0}) == [("follower_restarted", "follower-0", "")]
    assert kinds(ev, {"event": "follower_up", "follower": 0, "restarted": False, "time": 1.0}) == []
    assert kinds(ev, {"event": "reconciled", "version": 4, "lost": 2, "time": 1.0}) == [
        ("rollback", "leader", "")]
    assert faults_of(ev, {"event": "reconciled", "version": 4, "lost": 2, "time": 1.0})[0].detail \
        == "2 outer steps lost, back to version 4"
    assert kinds(ev, {"event": "reconciled", "version": 4, "lost": 0, "time": 1.0}) == []
    assert kinds(ev, {"event": "leader_resumed", "version": 4, "time": 1.0}) == [
        ("leader_restarted", "leader", "")]
    assert kinds(ev, {"event": "chunks_reassigned", "cluster": "b", "idle_holder": "a",
                      "chunks": [1, 2], "time": 1.0}) == [("chunks_reassigned", "cluster-a", "idle")]
    for quiet in ({"event": "cluster_joined", "cluster": "a", "time": 1.0},
                  {"event": "cluster_left", "cluster": "a", "time": 1.0},
                  {"event": "run_finished", "time": 1.0},
                  {"event": "cluster_removed", "cluster": "a"},  # no time: not a record
                  [1, 2]):
        assert faults_of(ev, quiet) == []


def test_the_window_lists_newest_first_and_counts_by_kind_and_reason():
    log = FaultLog(window_s=3600.0)
    log.add(faults_of("outer_steps", DECISION))  # t = 1000
    log.add([Fault(500.0, "follower_down", "follower-1", "heartbeat_timeout"),
             Fault(3000.0, "push_rejected", "cluster-b", "penalty"),
             Fault(2000.0, "rollback", "leader")])
    assert [(f.time, f.kind) for f in log.recent(4000.0)] == [
        (3000.0, "push_rejected"), (2000.0, "rollback"), (1000.0, "push_rejected"),
        (1000.0, "push_rejected"), (500.0, "follower_down")]
    assert log.counts(4000.0) == {("follower_down", "heartbeat_timeout"): 1,
                                  ("push_rejected", "not_delivered"): 1,
                                  ("push_rejected", "penalty"): 2, ("rollback", ""): 1}
    # the window is [now - 1 h, now]: t = 1000 is in it at 4600, not at 4601
    assert [f.time for f in log.recent(4600.0)] == [3000.0, 2000.0, 1000.0, 1000.0]
    assert [f.time for f in log.recent(4601.0)] == [3000.0, 2000.0]
    assert log.counts(5000.0) == {("push_rejected", "penalty"): 1, ("rollback", ""): 1}
    assert [f.time for f in log.recent(4000.0, limit=2)] == [3000.0, 2000.0]


def test_memory_is_bounded_and_bad_arguments_are_named():
    log = FaultLog(window_s=10.0, keep=3)
    log.add(Fault(float(t), "rollback", "leader") for t in range(10))
    assert [f.time for f in log.recent(9.0)] == [9.0, 8.0, 7.0]
    with pytest.raises(ValueError, match="window_s = 0"):
        FaultLog(window_s=0)
    with pytest.raises(ValueError, match="keep = 0"):
        FaultLog(keep=0)
    assert reason_class({"reason": "x", "code": "invalid"}) == "invalid"
    assert reason_class(None) == "other"


def test_a_rejection_is_classified_by_its_code_never_by_its_text():
    """Review of issue 15, #2: a push failed because follower 1 went down was counted
    ``invalid`` since its text starts with "follower "; the record's code says what it was,
    and the text, whatever it says, is never read."""
    down = {"score": None, "reason": "follower 1 down", "code": "followers_not_ready"}
    assert reason_class(down) == "followers_not_ready"
    assert reason_class({"reason": "follower 1: NaN in layer 3"}) == "other"  # no code: older
    assert reason_class({"reason": "penalty", "code": "penalty"}) == "penalty"
    assert reason_class({"reason": "invalid penalty", "code": "cluster_gone"}) == "cluster_gone"
    assert reason_class({"code": "made up"}) == "other"
    rec = {**DECISION, "rejected": {"b": down}}
    assert kinds("outer_steps", rec) == [("push_rejected", "cluster-b", "followers_not_ready")]
