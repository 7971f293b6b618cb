"""A cluster joining while a follower is down (review 28 of issue 15, #3: a restarted cluster
joined while follower 0 was down, its join's pull waited on the dead follower for the whole
pull timeout, 10 s of nothing trained, and once the run finished the leader removed it for
silence, counted as a fault).

* the leader refuses the join at once (NOT_READY, naming the follower) while it knows a
  follower is down, and takes it once the follower is back;
* the join's reply carries the leader's ``followers_epoch``, so the join's own pull is given
  up as soon as a follower goes down or comes back (it was not: the epoch came only with the
  first heartbeat reply);
* a cluster removed for silence after the run finished is its clean end, not a fault."""

from __future__ import annotations

import json
import time

import pytest

from dips.algo.faultlog import faults_of
from dips.algo.refusal import Refusal
from dips.roles.client import ClusterClient
from dips.roles.client_sync import FOLLOWERS_CHANGED
from dips.roles.leader import FollowerEntry
from dips.train.model import build_model
from dips.wire.pki import Identity
from dips.wire.security import Credentials
from tests.roles.test_hostile_leader import ManualClock, make_leader, member, refused, wait_for
from tests.roles.test_protocol import CFG, Run

pytestmark = pytest.mark.timeout(120)


def _entry(broken: str = "") -> FollowerEntry:
    return FollowerEntry(0, "tcp://127.0.0.1:1", "", ["l0", "l1"], [4, 4],
                         data_plane_error=broken)


def test_a_join_is_refused_while_a_follower_is_down_and_taken_once_it_is_back(tmp_path):
    leader, _ = make_leader(tmp_path, ledger=False)
    try:
        leader.register_follower(_entry("data plane stopped (the test's)"))  # marked down
        assert not leader.followers[0].up
        why = refused(lambda: leader.join_cluster("a", [["l0", "l1"]]), Refusal.NOT_READY)
        assert "follower(s) [0] down" in why and "a" not in leader.clusters
        leader.register_follower(_entry())  # back
        wait_for(lambda: leader.ready, "follower reconciled")
        assert leader.join_cluster("a", [["l0", "l1"]])[0] == 0
    finally:
        leader.stop()


def test_the_joins_pull_is_given_up_when_a_follower_goes_down_or_comes_back(tmp_path):
    """No heartbeat has answered yet (the test's client does not beat): the pull already
    watches the epoch the join's reply gave."""
    run = Run(tmp_path)
    seen: list = []

    class Watching(ClusterClient):
        def _start_heartbeat(self) -> None:
            pass

        def _pull(self, version: int) -> None:
            why = self._abandoned()
            seen.append((self._followers_epoch, why()))
            self._followers_epoch += 1  # what the next heartbeat reply brings after a change
            seen.append(why())
            self._followers_epoch -= 1
            super()._pull(version)

    c = Watching(build_model(CFG, seed=1), run.addr, "a",
                 Credentials.insecure(Identity.cluster("a")), H=2, timeout_s=60,
                 admit_timeout_s=60)
    try:
        assert c.join() == 0
        assert seen[0] == (run.leader.followers_epoch, None) and seen[0][0] > 0
        assert seen[1] == FOLLOWERS_CHANGED
    finally:
        c.close()
        run.close()


def test_a_cluster_removed_after_the_run_finished_is_not_a_fault(tmp_path):
    clock = ManualClock()
    leader, _ = make_leader(tmp_path, ledger=False, clock=clock, max_outer_steps=1)
    try:
        member(leader, "a")
        member(leader, "b")
        grant = leader.request_push("a", 0, 64, 5.0)
        assert leader.push_done("a", grant.push_id, True, "", 30.0).verdict.accepted
        wait_for(lambda: leader.status().finished, "the run finished")
        clock.advance(120.0)  # a and b stop without leaving: silent past the limit (60 s)

        def removed() -> list[dict]:
            recs = [json.loads(line) for line in
                    (tmp_path / "leader_events.jsonl").read_text().splitlines()]
            return [r for r in recs if r["event"] == "cluster_removed"]

        wait_for(lambda: len(removed()) == 2, "silent clusters removed (their records)")
        got = removed()
        assert sorted(r["cluster"] for r in got) == ["a", "b"]
        assert all(r["after_finish"] is True for r in got)
        assert [f for r in got for f in faults_of("leader_events", r)] == []
        _, counts, _ = leader.recent_faults(time.time() + 1.0)
        assert ("follower_down", "heartbeat_timeout") in counts  # the fake follower fell silent
        assert not any(kind == "cluster_removed" for kind, _ in counts), counts
    finally:
        leader.stop()
    before = {"time": 1.8e9, "event": "cluster_removed", "cluster": "a", "silent_s": 2.0}
    assert [f.reason for f in faults_of("leader_events", before)] == ["heartbeat_timeout"]
