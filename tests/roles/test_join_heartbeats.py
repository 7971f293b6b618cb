"""A cluster heartbeats from the leader's answer to its join on, through a slow pull or resume
(review 26, M6: a restarted cluster was removed for ``heartbeat_timeout`` while it was still
pulling the model and loading its state, since heartbeats only began after the join returned).

The slow resume is the test's: the client's first pull waits until the leader's clock is two
heartbeat timeouts past the join (or the leader removed the cluster, which is the bug)."""

from __future__ import annotations

import json

import pytest

from dips.roles.client import ClusterClient
from dips.spec import MembershipConfig
from dips.train.model import build_model
from dips.wire.pki import Identity
from dips.wire.security import Credentials
from tests.roles.test_protocol import CFG, Run, _wait_until

pytestmark = pytest.mark.timeout(120)

INTERVAL_S, MISSED = 0.2, 10  # removed after 2 s without a heartbeat


def events(run_dir, kind: str) -> list[dict]:
    recs = [json.loads(line) for line in (run_dir / "leader_events.jsonl").read_text().splitlines()]
    return [r for r in recs if r["event"] == kind]


def test_a_cluster_whose_resume_is_slow_is_not_removed(tmp_path):
    run = Run(tmp_path, membership=MembershipConfig(heartbeat_interval_s=INTERVAL_S,
                                                    missed_heartbeats=MISSED))
    timeout_s = INTERVAL_S * MISSED

    class SlowResume(ClusterClient):
        """Its first pull (the join's) takes two heartbeat timeouts of the leader's clock."""
        slow = True

        def _pull(self, version: int) -> None:
            if self.slow:
                self.slow = False
                joined = run.clock()
                _wait_until(lambda: run.clock() > joined + 2 * timeout_s
                            or "a" not in run.leader.clusters, "the slow resume", 60.0)
            super()._pull(version)

    c = SlowResume(build_model(CFG, seed=1), run.addr, "a",
                   Credentials.insecure(Identity.cluster("a")), H=2, timeout_s=60,
                   admit_timeout_s=60)  # the leader's heartbeat interval
    try:
        assert c.join() == 0
        c.step_done(100)
        res = c.step_done(100)  # H = 2: the first push
        assert res is not None and res.accepted, res
        assert [e for e in events(tmp_path, "cluster_removed") if e["cluster"] == "a"] == []
        assert [e["cluster"] for e in events(tmp_path, "cluster_joined")] == ["a"]
    finally:
        c.close()
        run.close()


def test_a_join_that_fails_stops_its_heartbeats(tmp_path):
    run = Run(tmp_path)

    class NoPull(ClusterClient):
        def _pull(self, version: int) -> None:
            raise TimeoutError("no follower answers (the test's)")

    c = NoPull(build_model(CFG, seed=1), run.addr, "a",
               Credentials.insecure(Identity.cluster("a")), H=2, timeout_s=60,
               admit_timeout_s=60, heartbeat_interval_s=0.2)
    try:
        with pytest.raises(RuntimeError, match="could not pull"):
            c.join(attempts=2)
        assert c._hb_thread is None  # no thread keeps a failed cluster a member
    finally:
        c.close(leave=False)
        run.close()
