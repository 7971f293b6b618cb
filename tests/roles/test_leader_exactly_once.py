"""Exactly once at the leader (issue 10), with followers faked in process: T_j comes from the
ledger, verdicts are durable and re-served (also by a restarted leader), a member removed in
the middle of an update is credited or handed out again but never both, and a follower lost
mid-round ends the round at once."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest

from dips.algo.ledger import ChunkLedger
from dips.algo.refusal import Refusal, Refused
from dips.roles.leader import FollowerEntry, Leader, LeaderConfig
from dips.spec import MembershipConfig, Timeouts

pytestmark = pytest.mark.timeout(60)
TPW = 64  # tokens per window


class FakeFollower:
    """A follower's control service that agrees to everything; ``gate`` holds ``apply``."""

    def __init__(self) -> None:
        self.version, self.prepared = 0, -1
        self.gate = threading.Event()
        self.gate.set()
        self.commit_gate = threading.Event()
        self.commit_gate.set()
        self.applied: list[tuple[int, list[str]]] = []

    def report(self):
        return self.version, self.prepared, [self.version]

    def restore(self, version):
        self.version, self.prepared = version, -1
        return version, "x"

    def abort(self, rnd):
        self.prepared = -1

    def discard(self, rnd):
        pass

    def score(self, rnd, clusters, push_ids=None, retired=None):
        return [(c, True, 1.0, "") for c in clusters]

    def aggregate(self, rnd, clusters, weights):
        return 0.25

    def apply(self, rnd, clip, new_version, accepted, weights):
        assert self.gate.wait(20)
        self.prepared = new_version
        self.applied.append((new_version, list(accepted)))
        return new_version, f"sum{new_version}"

    def commit(self, new_version):
        if not self.commit_gate.wait(5):
            raise TimeoutError("commit held")
        self.version, self.prepared = new_version, -1
        return new_version, f"sum{new_version}"


class Run:
    """A started leader with two fake followers that heartbeat until told to stop."""

    def __init__(self, tmp_path, push_s: float = 60.0, fakes: list | None = None,
                 window_s: float = 0.0) -> None:
        cfg = LeaderConfig(followers=2, grace={"window_s": window_s},
                           membership=MembershipConfig(heartbeat_interval_s=0.2),
                           timeouts=Timeouts(push_s=push_s, pull_s=push_s))
        self.fakes = fakes or [FakeFollower(), FakeFollower()]
        self.ledger = ChunkLedger(4, 10)
        self.leader = Leader(cfg, connect=lambda e: self.fakes[e.index], run_dir=tmp_path,
                             ledger=self.ledger, tokens_per_window=TPW)
        self.entries = [FollowerEntry(0, "tcp://x:1", "", ["l0"], [4]),
                        FollowerEntry(1, "tcp://x:2", "", ["l1"], [4])]
        self.beating = {0, 1}
        self._stop = threading.Event()
        for e in self.entries:
            self.leader.register_follower(e)
        self._beat = threading.Thread(target=self._heartbeats, daemon=True)
        self._beat.start()
        self.leader.start()
        wait_for(lambda: self.leader.ready, "followers reconciled")

    def _heartbeats(self) -> None:
        while not self._stop.wait(0.05):
            for e in self.entries:
                if e.index in self.beating:
                    self.leader.register_follower(e)
            for c in list(self.leader.clusters):  # the members heartbeat too
                self.leader.heartbeat(c, 0, 0, 0.0)

    def member(self, cid: str) -> dict[int, int]:
        """Join ``cid`` and lease it two chunks; returns chunk -> start position."""
        self.leader.join_cluster(cid, [["l0", "l1"]])
        holdings, _, _ = self.leader.lease(cid, 2)
        return dict(holdings)

    def close(self) -> None:
        self._stop.set()
        self._beat.join(5)
        self.leader.stop()


def wait_for(cond, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)


@pytest.fixture
def run(tmp_path):
    r = Run(tmp_path)
    yield r
    r.close()


def test_tokens_come_from_the_ledger_and_an_empty_push_is_refused(run):
    chunks = run.member("a")
    c0 = min(chunks)
    with pytest.raises(Refused) as info:
        run.leader.request_push("a", 0, 5000, 5.0, {c0: chunks[c0]})
    assert info.value.code is Refusal.NOTHING_TRAINED
    with pytest.raises(Refused) as info:  # a chunk it does not hold
        run.leader.request_push("a", 0, 5000, 5.0, {3 if c0 != 3 else 2: 1})
    assert info.value.code is Refusal.LEDGER_CONFLICT
    grant = run.leader.request_push("a", 0, 999_999, 5.0, {c0: 3})  # the claim is not believed
    reply = run.leader.push_done("a", grant.push_id, True, "", 10.0)
    assert reply.verdict.accepted and reply.verdict.version == 1
    assert run.leader.counts["tokens_accepted"] == 3 * TPW == run.leader.counts["tokens_pushed"]
    assert run.ledger.accepted_windows == 3 and dict(reply.holdings)[c0] == 3


def test_a_verdict_is_reserved_also_by_a_restarted_leader(tmp_path):
    run = Run(tmp_path)
    try:
        chunks = run.member("a")
        c0 = min(chunks)
        grant = run.leader.request_push("a", 0, 1, 5.0, {c0: 4})
        first = run.leader.push_done("a", grant.push_id, True, "", 10.0)
        again = run.leader.push_done("a", grant.push_id, True, "", 1.0)  # the reply was lost
        assert again == first
        wait_for(lambda: run.leader.phase == "idle", "round ended")
    finally:
        run.close()
    restarted = Run(tmp_path, fakes=run.fakes)  # the followers outlive the leader
    try:
        reply = restarted.leader.push_done("a", grant.push_id, True, "", 1.0)
        assert reply.verdict == first.verdict and reply.holdings == first.holdings
        assert restarted.leader.version == 1 and restarted.leader.counts["updates_accepted"] == 1
        with pytest.raises(Refused) as info:
            restarted.leader.push_done("a", "no-such-push", True, "", 1.0)
        assert info.value.code is Refusal.UNKNOWN_PUSH
    finally:
        restarted.close()


def test_a_leader_dead_between_its_decision_and_the_commits_re_serves_the_verdict(tmp_path):
    """Input 1 of issue 10 in process: the step is decided (every follower prepared it) and the
    leader dies before any follower commits. The restarted leader rolls the step forward and
    answers the cluster's second ask with the same verdict, counting nothing twice."""
    run = Run(tmp_path)
    try:
        chunks = run.member("a")
        c0 = min(chunks)
        for f in run.fakes:
            f.commit_gate.clear()  # the commits never come: the leader "dies" here
        grant = run.leader.request_push("a", 0, 1, 5.0, {c0: 5})
        def ask() -> None:  # the cluster's first ask: the leader dies before it answers
            with contextlib.suppress(Refused):
                run.leader.push_done("a", grant.push_id, True, "", 3.0)

        threading.Thread(target=ask, daemon=True).start()
        wait_for(lambda: run.leader.version == 1, "decision recorded")
    finally:
        run._stop.set()
        run.leader.stop(timeout_s=0.1)  # its loop thread is stuck in a commit: abandoned
    fakes = run.fakes
    for f in fakes:
        assert f.prepared == 1 and f.version == 0  # prepared everywhere, committed nowhere
        f.commit_gate.set()
    restarted = Run(tmp_path, fakes=fakes)
    try:
        reply = restarted.leader.push_done("a", grant.push_id, True, "", 5.0)
        assert reply.verdict.accepted and reply.verdict.version == 1
        assert dict(reply.holdings)[c0] == 5
        assert all(f.version == 1 for f in fakes)  # rolled forward on every follower
        counts = restarted.leader.counts
        assert counts["updates_accepted"] == counts["updates_pushed"] == 1
        assert counts["tokens_accepted"] == 5 * TPW == restarted.leader.ledger.accepted_windows * TPW
    finally:
        restarted.close()


def test_a_member_removed_during_the_update_is_credited_not_handed_out_twice(run):
    chunks = run.member("a")
    c0 = min(chunks)
    for f in run.fakes:
        f.gate.clear()  # hold the update between scoring and the decision
    grant = run.leader.request_push("a", 0, 1, 5.0, {c0: 6})
    verdict: list = []
    waiter = threading.Thread(target=lambda: verdict.append(
        run.leader.push_done("a", grant.push_id, True, "", 20.0)), daemon=True)
    waiter.start()
    wait_for(lambda: run.leader.phase == "update", "update phase")
    run.leader.leave("a")
    # Its chunks are not handed out while the step that may credit them is being decided.
    assert c0 not in run.ledger.free_chunks()
    for f in run.fakes:
        f.gate.set()
    waiter.join(20)
    assert verdict and verdict[0].verdict.accepted
    # Credited: the next holder resumes at window 6, never trains 0..5 again.
    assert run.ledger.chunks[c0].accepted == 6 and run.ledger.chunks[c0].holder is None
    assert run.ledger.accepted_windows == 6
    assert run.leader.counts["tokens_accepted"] == 6 * TPW


def test_a_follower_lost_mid_round_ends_it_at_once(tmp_path):
    # The round must wait for neither the push timeout nor its window; the long window keeps
    # b's request in a's round whatever the scheduling (a window of 0 s may close before b asks).
    run = Run(tmp_path, push_s=600.0, window_s=600.0)
    try:
        ca, cb = run.member("a"), run.member("b")
        ga = run.leader.request_push("a", 0, 1, 5.0, {min(ca): 2})
        gb = run.leader.request_push("b", 0, 1, 5.0, {min(cb): 2})
        assert ga.round == gb.round
        out: list = []
        waiter = threading.Thread(target=lambda: out.append(
            run.leader.push_done("a", ga.push_id, True, "", 30.0)), daemon=True)
        waiter.start()  # b never reports: its push hangs on the dead follower
        run.beating.discard(1)  # follower 1 dies: 3 missed heartbeats of 0.2 s
        waiter.join(30)
        assert out, "the round waited for the push timeout"
        v = out[0].verdict
        assert not v.accepted and v.reason == "follower 1 down"
        assert run.leader.version == 0 and all(f.applied == [] for f in run.fakes)
        # Review of issue 15, #2: the record carries the typed reason (its text starts with
        # "follower ", which once made it "invalid"), and the faults read the code.
        wait_for(lambda: (tmp_path / "outer_steps.jsonl").is_file(), "the round recorded")
        recs = [json.loads(line) for line in
                (tmp_path / "outer_steps.jsonl").read_text().splitlines()]
        rejected = next(r["rejected"] for r in recs if "event" not in r and r["rejected"])
        assert {c: w["code"] for c, w in rejected.items()} == {
            "a": "followers_not_ready", "b": "followers_not_ready"}
        assert {f.reason for f in run.leader.recent_faults(time.time())[0]
                if f.kind == "push_rejected"} == {"followers_not_ready"}
        # Nothing was counted: the ledger hands those windows out again.
        assert run.ledger.accepted_windows == 0 and run.leader.counts["tokens_accepted"] == 0
    finally:
        run.close()


def test_measured_push_times_survive_a_leader_restart(tmp_path):
    """Review input: after a leader restart, a slow link's next push joined a round (holding it
    for its whole transfer) instead of going ahead, because the leader had forgotten how long
    that cluster's pushes take. They are now part of ``leader.json``."""
    run = Run(tmp_path)
    try:
        c0 = min(run.member("a"))
        grant = run.leader.request_push("a", 0, 1, 5.0, {c0: 4})
        run.leader.push_done("a", grant.push_id, True, "", 10.0)
        wait_for(lambda: run.leader.phase == "idle", "round ended")
        measured = dict(run.leader._state.push_s)
        assert set(measured) == {"a"}
    finally:
        run.close()
    restarted = Run(tmp_path, fakes=run.fakes)
    try:
        assert dict(restarted.leader._state.push_s) == measured
    finally:
        restarted.close()
