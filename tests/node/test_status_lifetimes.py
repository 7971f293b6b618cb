"""``dips status`` and the leader's per-cluster metrics count over a cluster's processes
(review 28 of issue 15, #2: a restarted cluster's inner step and tokens dropped to about 0,
its own process's, while its train.jsonl and summary.json counted on). Tokens pushed and
accepted per cluster are the leader's ledger counts, kept across the cluster's re-joins and
the leader's own restarts (leader.json); the inner step is the cluster's own numbering, which
a process that resumed a saved inner state counts on from."""

from __future__ import annotations

import time

import pytest

from dips.node.metrics import _LeaderState
from dips.node.status import snapshot
from dips.roles.client import ClusterClient
from dips.roles.leader import FollowerEntry, Leader, LeaderConfig
from dips.spec import MembershipConfig, Timeouts
from dips.train.model import build_model
from dips.wire.pb import control_pb2 as pb
from dips.wire.pki import Identity
from dips.wire.security import Credentials
from dips.wire.services import LeaderServicer
from tests.roles.test_hostile_leader import (
    FakeContext,
    TPW,
    FakeFollower,
    make_leader,
    member,
    wait_for,
)
from tests.roles.test_protocol import CFG, Run, _wait_until

pytestmark = pytest.mark.timeout(120)


def _push(leader, cid: str, tokens: int, ok: bool = True) -> bool:
    grant = leader.request_push(cid, leader.version, tokens, 5.0)
    accepted = leader.push_done(cid, grant.push_id, ok, "" if ok else "lost", 30.0).verdict.accepted
    wait_for(lambda: leader.phase == "idle", "round ended")
    return accepted


def _rows(leader) -> dict[str, dict]:
    reply = LeaderServicer(leader, None).GetStatus(pb.StatusRequest(), FakeContext("admin"))
    return {c["cluster_id"]: c for c in snapshot(reply, "l", time.time())["clusters"]}


def _metric(leader, name: str) -> dict[str, float]:
    fams = {f.name: f for f in _LeaderState(leader, time.monotonic).collect()}
    return {s.labels["cluster"]: s.value for s in fams[name].samples}


def _leader_over(tmp_path, version: int) -> Leader:
    """make_leader's leader, its fake follower holding ``version`` (committed)."""
    fake = FakeFollower()
    fake.version = version
    config = LeaderConfig(followers=1, membership=MembershipConfig(heartbeat_interval_s=1.0,
                                                                   missed_heartbeats=60),
                          timeouts=Timeouts(push_s=60.0, pull_s=60.0))
    leader = Leader(config, connect=lambda e: fake, run_dir=tmp_path, tokens_per_window=TPW)
    leader.register_follower(FollowerEntry(0, "tcp://127.0.0.1:1", "", ["l0", "l1"], [4, 4]))
    leader.start()
    wait_for(lambda: leader.ready, "follower reconciled")
    return leader


def test_tokens_per_cluster_survive_its_rejoin_and_the_leaders_restart(tmp_path):
    leader, _ = make_leader(tmp_path, ledger=False)
    try:
        member(leader, "a")
        member(leader, "b")
        assert _push(leader, "a", 100) and _push(leader, "b", 30)
        assert not _push(leader, "b", 20, ok=False)  # not delivered: pushed, not accepted
        member(leader, "a")  # a's new process joins again
        leader.heartbeat("a", 2, 50, 4.0)
        assert _push(leader, "a", 50)
        rows = _rows(leader)
        assert (rows["a"]["tokens_accepted"], rows["a"]["tokens_pushed"]) == (150, 150)
        assert rows["b"]["tokens_accepted"] == 30 and rows["b"]["tokens_pushed"] in (30, 50)
        assert _metric(leader, "dips_cluster_tokens_accepted") == {"a": 150.0, "b": 30.0}
        assert _metric(leader, "dips_cluster_inner_step")["a"] == 2.0
    finally:
        leader.stop()
    for kept, accepted in ((3, 150), (1, 100)):  # the follower kept version 3; lost 2 and 3
        again = _leader_over(tmp_path, kept)  # resumes from leader.json
        try:
            member(again, "a")
            rows = _rows(again)
            assert again.version == kept
            assert (rows["a"]["tokens_accepted"], rows["a"]["tokens_pushed"]) == (accepted, 150)
            assert again.counts["tokens_accepted"] == accepted + (30 if kept == 3 else 0)
        finally:
            again.stop()


def test_a_resumed_process_heartbeats_its_clusters_step_numbering(tmp_path):
    """The process resumed a state saved at step 199 (its train.jsonl goes on at 200): the
    leader was told inner step 1 after its first step, not 200."""
    run = Run(tmp_path)
    c = ClusterClient(build_model(CFG, seed=1), run.addr, "a",
                      Credentials.insecure(Identity.cluster("a")), H=2, timeout_s=60,
                      admit_timeout_s=60, heartbeat_interval_s=0.1)
    try:
        c.count_from(199, 50_944)
        assert c.join() == 0
        c.step_done(256)
        # A heartbeat sent between the join and the step may carry the resumed count (199).
        entry = _wait_until(lambda: next((e for e in run.leader.status().clusters
                                          if e.cluster_id == "a"
                                          and e.inner_step not in (0, 199)), None),
                            "a heartbeat after the first step")
        assert (entry.inner_step, entry.tokens) == (200, 51_200)
        res = c.step_done(256)  # H = 2 steps after the join: it pushes
        assert res is not None and res.accepted, res
        with pytest.raises(ValueError, match="steps = -1"):
            c.count_from(-1, 0)
    finally:
        c.close()
        run.close()
