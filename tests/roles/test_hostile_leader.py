"""Hostile members at the leader (issue 13): a member with valid credentials cannot make the
leader believe its token count, overflow a count, stall it by holding pushes or flooding it
with calls, reuse a round number after a crash, or make it lose its checkpoint. Followers are
faked in process; the gRPC tests use a real server on 127.0.0.1 (a free port)."""

from __future__ import annotations

import json
import math
import threading
import time

import grpc
import pytest

from dips.algo.ledger import ChunkLedger
from dips.algo.penalty import PenaltyState
from dips.algo.refusal import Refusal, Refused
from dips.algo.round import (
    PushReported,
    PushRequested,
    RoundPolicy,
    RoundState,
    Slot,
    Staged,
    Tick,
    UpdateFinished,
    UpdateOutcome,
    step,
)
from dips.roles.leader import FollowerEntry, Leader, LeaderConfig
from dips.roles.outer_step import run_update
from dips.spec import (
    GraceConfig,
    MembershipConfig,
    OuterConfig,
    PenaltyConfig,
    RunConfig,
    Timeouts,
)
from dips.spec.run import PUSH_TOKENS_SLACK
from dips.wire import admission
from dips.wire.control import MAX_DETAILS, REFUSAL_KEY, Client, make_server, refusal_of
from dips.wire.inflight import CallGate
from dips.wire.pb import control_pb2 as pb
from dips.wire.pb import control_pb2_grpc as pbg
from dips.wire.pki import Identity
from dips.wire.security import IDENTITY_KEY, Credentials
from dips.wire.services import LeaderServicer
from tests.servicer_context import Aborted, FakeContext

pytestmark = pytest.mark.timeout(120)
TPW = 64  # tokens per ledger window
INT64_MAX = 2**63 - 1


class FakeFollower:
    """A follower's control service that agrees to everything and records what it applied."""

    def __init__(self) -> None:
        self.version = 0
        self.applied: list[tuple[int, list[str], list[float]]] = []

    def report(self):
        return self.version, -1, [self.version]

    def restore(self, version):
        self.version = version
        return version, "x"

    def abort(self, rnd):
        pass

    def discard(self, rnd):
        pass

    def score(self, rnd, clusters, push_ids=None, retired=None):
        return [(c, True, 1.0, "") for c in clusters]

    def aggregate(self, rnd, clusters, weights):
        return 0.25

    def apply(self, rnd, clip, new_version, accepted, weights):
        self.applied.append((new_version, list(accepted), list(weights)))
        return new_version, f"sum{new_version}"

    def commit(self, new_version):
        self.version = new_version
        return new_version, f"sum{new_version}"


class ManualClock:
    """The leader's clock, moved only by the test: a window stays open until it is moved."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def wait_for(cond, what: str, timeout_s: float = 30.0):
    """Poll ``cond`` until it holds (the event); fail after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)
    return value


def make_leader(tmp_path, *, ledger: bool = True, clock=None, window_s: float = 0.0,
                push_s: float = 60.0, **cfg) -> tuple[Leader, FakeFollower]:
    """A started leader with one fake follower owning layers l0, l1 (ready to admit)."""
    config = LeaderConfig(followers=1, grace=GraceConfig(window_s=window_s),
                          membership=MembershipConfig(heartbeat_interval_s=1.0,
                                                      missed_heartbeats=60),
                          timeouts=Timeouts(push_s=push_s, pull_s=push_s), **cfg)
    fake = FakeFollower()
    leader = Leader(config, connect=lambda e: fake, run_dir=tmp_path,
                    ledger=ChunkLedger(8, 10) if ledger else None, tokens_per_window=TPW,
                    clock=clock or time.monotonic)
    leader.register_follower(FollowerEntry(0, "tcp://127.0.0.1:1", "", ["l0", "l1"], [4, 4]))
    leader.start()
    wait_for(lambda: leader.ready, "follower reconciled")
    return leader, fake


def member(leader: Leader, cid: str) -> dict[int, int]:
    """Join ``cid``; with a ledger, lease it two chunks (chunk -> start position)."""
    leader.join_cluster(cid, [["l0", "l1"]])
    return dict(leader.lease(cid, 2)[0]) if leader.ledger is not None else {}


def ticket_of(leader: Leader, grant) -> admission.Ticket:
    key = admission.admission_key(leader.issued.data_secret)
    return admission.verify(key, grant.ticket, grant.ticket_mac.hex())


def refused(call, code: Refusal) -> str:
    with pytest.raises(Refused) as info:
        call()
    assert info.value.code is code, info.value
    return info.value.message


# ----- T_j and the counts (issue input 2) ----------------------------------------------------
def test_a_claim_of_1e18_tokens_weighs_only_its_ledger_count(tmp_path):
    clock = ManualClock()
    leader, fake = make_leader(tmp_path, clock=clock, window_s=5.0)
    try:
        ca, cb = member(leader, "a"), member(leader, "b")
        ga = leader.request_push("a", 0, 10**18, 5.0, {min(ca): 3})
        gb = leader.request_push("b", 0, 10**4, 5.0, {min(cb): 3})
        assert ga.round == gb.round == 1  # the clock stands: one window
        assert ticket_of(leader, ga).tokens == ticket_of(leader, gb).tokens == 3 * TPW
        clock.advance(5.0)  # the window closes
        verdicts: list = []
        waiter = threading.Thread(target=lambda: verdicts.append(
            leader.push_done("a", ga.push_id, True, "", 30.0)), daemon=True)
        waiter.start()
        verdicts.append(leader.push_done("b", gb.push_id, True, "", 30.0))
        waiter.join(30)
        assert all(v.verdict.accepted for v in verdicts) and len(verdicts) == 2
        assert fake.applied == [(1, ["a", "b"], [0.5, 0.5])]  # not 0.99999999999999
        assert leader.counts["tokens_accepted"] == leader.counts["tokens_pushed"] == 6 * TPW
    finally:
        leader.stop()


def test_a_member_lying_about_its_ledger_positions_weighs_at_most_a_full_push(tmp_path):
    """Found by a review: T_j is the ledger's count of the windows a member *reports*, so a
    member that reported every held chunk trained to its end took 99.4% of the mean (715,520
    tokens against 2,048), and marked all those windows trained. The ledger now credits a push
    with at most ``max_push_tokens`` worth of windows (chunk order), so the member weighs and
    uses up at most one full push's data; its verdict's holdings rewind it to the credit."""
    clock = ManualClock()
    leader, fake = make_leader(tmp_path, clock=clock, window_s=5.0, max_push_tokens=3 * TPW)
    try:
        ca, cb = member(leader, "a"), member(leader, "h")
        ga = leader.request_push("a", 0, 3 * TPW, 5.0, {min(ca): 3})
        gh = leader.request_push("h", 0, 3 * TPW, 5.0, {c: 10 for c in cb})  # 2 chunks to the end
        assert ticket_of(leader, gh).tokens == 3 * TPW  # not the 20 windows it reported
        clock.advance(5.0)
        verdicts: list = []
        waiter = threading.Thread(target=lambda: verdicts.append(
            leader.push_done("h", gh.push_id, True, "", 30.0)), daemon=True)
        waiter.start()
        verdicts.append(leader.push_done("a", ga.push_id, True, "", 30.0))
        waiter.join(30)
        assert fake.applied == [(1, ["a", "h"], [0.5, 0.5])]  # not [0.13, 0.87]
        assert leader.counts["tokens_accepted"] == 6 * TPW
        first, second = sorted(cb)
        held = {v.verdict.cluster_id: dict(v.holdings) for v in verdicts}
        assert held["h"] == {first: 3, second: 0}  # the rest of its claim is free to train
        assert leader.ledger.chunks[second].accepted == 0
    finally:
        leader.stop()


def test_without_a_ledger_a_claim_is_cut_to_the_runs_per_push_maximum(tmp_path):
    leader, _ = make_leader(tmp_path, ledger=False, max_push_tokens=1000)
    try:
        member(leader, "a")
        grant = leader.request_push("a", 0, 10**18, 5.0)
        assert ticket_of(leader, grant).tokens == 1000
        assert "tokens" in refused(lambda: leader.request_push("a", 0, 2**64, 5.0),
                                   Refusal.INVALID_ARGUMENT)
    finally:
        leader.stop()
    inner = RunConfig().inner
    assert LeaderConfig.from_run(RunConfig()).max_push_tokens == \
        PUSH_TOKENS_SLACK * inner.H * inner.batch_size * inner.seq_len


def test_two_claims_of_int64_max_saturate_the_counts_and_status_still_encodes(tmp_path):
    leader, _ = make_leader(tmp_path, ledger=False)  # no per-push maximum: the worst case
    servicer = LeaderServicer(leader, None)
    try:
        member(leader, "a")
        for _ in range(2):
            grant = leader.request_push("a", leader.version, INT64_MAX, 5.0)
            assert leader.push_done("a", grant.push_id, True, "", 30.0).verdict.accepted
            wait_for(lambda: leader.phase == "idle", "round ended")
        assert leader.counts["tokens_pushed"] == leader.counts["tokens_accepted"] == INT64_MAX
        status = servicer.GetStatus(pb.StatusRequest(), FakeContext("admin"))
        assert status.tokens_pushed == INT64_MAX and status.outer_steps == 2
    finally:
        leader.stop()
    saved = json.loads((tmp_path / "leader.json").read_text())
    assert saved["counts"]["tokens_pushed"] == INT64_MAX
    saved["counts"]["tokens_pushed"] = 2**64  # what an older leader persisted
    (tmp_path / "leader.json").write_text(json.dumps(saved))
    again, _ = make_leader(tmp_path, ledger=False)
    try:
        assert again.counts["tokens_pushed"] == INT64_MAX
        status = LeaderServicer(again, None).GetStatus(pb.StatusRequest(), FakeContext("admin"))
        assert status.tokens_pushed == INT64_MAX
    finally:
        again.stop()


def test_heartbeat_reports_are_clamped_and_never_reach_the_budget(tmp_path):
    leader, _ = make_leader(tmp_path, token_budget=10)
    servicer = LeaderServicer(leader, None)
    try:
        member(leader, "a")
        beat = lambda **kw: servicer.Heartbeat(pb.HeartbeatRequest(cluster_id="a", **kw),  # noqa: E731
                                               FakeContext("cluster-a"))
        assert beat(inner_step=3, tokens=7, last_loss=2.5).known
        for loss in (math.nan, math.inf, -math.inf, -1e300):  # -1e300: found by a review
            assert beat(inner_step=-5, tokens=INT64_MAX, last_loss=loss).known
        entry = leader.status().clusters[0]
        assert (entry.inner_step, entry.tokens, entry.last_loss) == (0, INT64_MAX, 2.5)
        assert beat(last_loss=1e300).known and leader.status().clusters[0].last_loss == 1e6
        with leader._cond:
            assert not leader._check_limits()  # 2**63 - 1 reported, 0 accepted: it goes on
        assert leader.status().finished == ""
    finally:
        leader.stop()


def test_the_launchers_probe_takes_a_refusal_as_an_answer():
    from dips.emu.launcher import _probe

    class Refusing(grpc.RpcError):
        def trailing_metadata(self):
            return ((REFUSAL_KEY, str(int(Refusal.BUSY))),)

    class Silent(grpc.RpcError):
        def trailing_metadata(self):
            return ()

    class FakeClient:
        def __init__(self, exc):
            self.exc = exc

        def GetStatus(self, request, timeout):
            raise self.exc

    assert _probe(FakeClient(Refusing())) == (None, True)  # alive: not restarted
    assert _probe(FakeClient(Silent())) == (None, False)


# ----- one slow member cannot starve the leader (issue input 5) ------------------------------
class Site:
    """A leader behind a real 12-thread gRPC server on 127.0.0.1 (insecure identities; on
    ``port``, 0: a free one); its clock stands until the test moves it (a grace window of 5 s
    stays open until then)."""

    def __init__(self, tmp_path, workers: int = 12, port: int = 0) -> None:
        self.clock = ManualClock()
        self.leader, _ = make_leader(tmp_path, ledger=False, push_s=600.0, clock=self.clock,
                                     window_s=5.0)
        self.gate = CallGate.for_server(workers)
        self.server = make_server(max_workers=workers)
        entry = lambda i: FollowerEntry(i.index, i.data_endpoint, i.control_endpoint,  # noqa: E731
                                        list(i.layers), list(i.layer_bytes), i.incarnation)
        pbg.add_LeaderServicer_to_server(LeaderServicer(self.leader, entry, gate=self.gate),
                                         self.server)
        self.port = Credentials.insecure(Identity.leader()).add_port(self.server,
                                                                     f"127.0.0.1:{port}")
        assert self.port
        self.server.start()
        self.clients: list[Client] = []
        self.channels: list[grpc.Channel] = []

    def client(self, name: str) -> Client:
        c = Client(pbg.LeaderStub, f"127.0.0.1:{self.port}",
                   Credentials.insecure(Identity.parse(name)), Identity.leader(), timeout_s=10)
        self.clients.append(c)
        return c

    def stub(self, name: str) -> tuple[pbg.LeaderStub, tuple]:
        """A raw stub (for calls left waiting as futures) and the metadata naming ``name``."""
        # A connection of its own, as each member process has (servers limit calls per
        # connection: dips.wire.control.STREAMS_PER_CONNECTION).
        channel = grpc.insecure_channel(f"127.0.0.1:{self.port}",
                                        options=[("grpc.use_local_subchannel_pool", 1)])
        self.channels.append(channel)
        return pbg.LeaderStub(channel), ((IDENTITY_KEY, name),)

    def join(self, name: str) -> Client:
        c = self.client(name)
        c.JoinCluster(pb.JoinRequest(stages=[pb.StageLayers(layers=["l0", "l1"])]))
        return c

    def close(self) -> None:
        self.leader.stop()
        self.server.stop(0).wait(5)
        for c in self.clients:
            c.close()
        for ch in self.channels:
            ch.close()


@pytest.fixture
def site(tmp_path):
    s = Site(tmp_path)
    yield s
    s.close()


def test_a_held_push_and_13_waiting_requests_leave_heartbeats_their_threads(site):
    evil = site.join("cluster-evil")
    grant = evil.RequestPush(pb.PushRequest(base_version=0, tokens=1))
    assert grant.round == 1 and grant.ticket  # admitted; it never reports: the round is held
    site.clock.advance(5.0)  # the window closes; the push phase waits 600 s for evil
    wait_for(lambda: site.leader.phase == "push", "round 1 in its push phase")
    good = site.join("cluster-good")
    stubs = [site.stub(f"cluster-q{i}") for i in range(13)]
    for i in range(13):
        site.join(f"cluster-q{i}")
    waiting = [stub.RequestPush.future(pb.PushRequest(base_version=0, tokens=1), timeout=60,
                                       metadata=meta) for stub, meta in stubs]
    # Each request either waits for the next round or is refused at once: never more waiting
    # calls than the gate lets block; the other threads stay free.
    blocking = site.gate.blocking
    wait_for(lambda: len(site.leader._state.queue) == blocking
             and sum(f.done() for f in waiting) == 13 - blocking, "requests parked or refused")
    busy = [f.exception() for f in waiting if f.done()]
    assert all(refusal_of(e) is Refusal.BUSY and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
               for e in busy)
    follower = site.client("follower-0")
    info = pb.FollowerInfo(index=0, data_endpoint="tcp://127.0.0.1:1", layers=["l0", "l1"],
                           layer_bytes=[4, 4])
    for _ in range(20):  # the honest cluster's and the follower's heartbeats all get through
        assert good.Heartbeat(pb.HeartbeatRequest(), timeout=10).known
        follower.RegisterFollower(info, timeout=10)
    assert "good" in site.leader.clusters and site.leader.followers[0].up
    for f in waiting:
        f.cancel()
    # A cancelled wait frees its thread and its place at once (not at its deadline).
    wait_for(lambda: site.gate.in_progress() == 0, "cancelled waits ended")


def test_a_member_has_one_waiting_request_and_one_verdict_wait_at_a_time(site):
    evil, other = site.join("cluster-evil"), site.join("cluster-other")
    grant = evil.RequestPush(pb.PushRequest(base_version=0, tokens=1))
    other.RequestPush(pb.PushRequest(base_version=0, tokens=1))  # same window: the clock stands
    stub, meta = site.stub("cluster-evil")
    done = pb.PushDoneRequest(push_id=grant.push_id, ok=True, error="x" * 10_000)
    first = stub.PushDone.future(done, timeout=60, metadata=meta)  # waits: round undecided
    wait_for(lambda: site.gate.in_progress() == 1, "the first verdict wait in progress")
    with pytest.raises(grpc.RpcError) as info:
        stub.PushDone(done, timeout=10, metadata=meta)
    assert refusal_of(info.value) is Refusal.BUSY
    first.cancel()
    wait_for(lambda: site.gate.in_progress() == 0, "the cancelled wait ended")
    assert site.leader._state.current.slots["evil"].done  # its report counted once


def test_a_member_that_stalls_holds_one_round_and_its_next_push_goes_ahead():
    """The push phase waits for a multiple of the measured push times, not a fixed 60 s; a
    push that never arrived counts as that slow, so the member's next push is sent ahead of
    its round (it holds no round again)."""
    pol = RoundPolicy(GraceConfig(window_s=1.0), push_timeout_s=60.0)  # floor 2 s, slack 4
    s = RoundState()
    s, _ = step(s, PushRequested(0.0, "good", "p1", 0, 5), pol)
    s, _ = step(s, Tick(1.0), pol)
    s, _ = step(s, PushReported(1.5, "good", "p1", True), pol)  # measured: 1.5 s
    s, _ = step(s, UpdateFinished(2.0, 1, UpdateOutcome(1, ("good",))), pol)
    s, _ = step(s, PushRequested(10.0, "good", "p2", 1, 5), pol)
    s, _ = step(s, PushRequested(10.0, "evil", "p3", 0, 5), pol)  # predicts nothing
    s, _ = step(s, Tick(11.0), pol)
    assert s.current.push_deadline == 10.0 + 2.0 + 4 * 1.5  # not 11 + 60
    s, _ = step(s, PushReported(11.0, "good", "p2", True), pol)
    s, _ = step(s, Tick(s.current.push_deadline), pol)  # evil never reports
    assert not s.current.slots["evil"].ok
    s, _ = step(s, UpdateFinished(18.1, 2, UpdateOutcome(2, ("good",))), pol)
    s, actions = step(s, PushRequested(20.0, "evil", "p4", 0, 5), pol)
    assert any(isinstance(a, Staged) for a in actions)  # ahead: no round waits for it
    s, _ = step(s, PushRequested(20.0, "good", "p5", 2, 5), pol)
    s, _ = step(s, Tick(21.0), pol)
    assert set(s.current.slots) == {"good"} and s.current.push_deadline <= 21.0 + 60.0


# ----- a large finite value fails only its own push (issue input 4, at the leader) -----------
def test_a_non_finite_norm_invalidates_only_its_own_push():
    class Overflowing(FakeFollower):
        def score(self, rnd, clusters, push_ids=None, retired=None):  # 1e30 per value: ‖Δ‖² is inf
            return [(c, True, math.inf if c == "evil" else 1.0, "") for c in clusters]

    slots = [Slot(c, f"{i:016x}", 0, 100, 0.0, round=1, admitted_at=0.0, done=True, ok=True)
             for i, c in enumerate(("evil", "good"))]
    report = run_update([(0, Overflowing())], 1, slots, 0, PenaltyState(), PenaltyConfig(),
                        OuterConfig())
    assert not report.failed and report.outcome.accepted == ("good",)
    assert "not a finite" in report.outcome.invalid["evil"]
    assert report.record(1)["rejected"]["evil"]["code"] == "invalid"  # typed, not its text

    class Confused(FakeFollower):
        def score(self, rnd, clusters, push_ids=None, retired=None):
            return [("stranger", True, 1.0, "")]

    report = run_update([(0, Confused())], 1, slots, 0, PenaltyState(), PenaltyConfig(),
                        OuterConfig())
    assert report.failed and report.outcome.accepted == ()  # nothing applied anywhere
    assert {c: w["code"] for c, w in report.record(1)["rejected"].items()} == {
        "evil": "round_failed", "good": "round_failed"}


# ----- replay: tickets and round numbers (issue input 6) -------------------------------------
def test_a_grant_carries_a_signed_ticket_and_a_base_ahead_of_the_leader_is_refused(tmp_path):
    leader, _ = make_leader(tmp_path)
    try:
        chunks = member(leader, "a")
        assert "base_version" in refused(
            lambda: leader.request_push("a", 1, 1, 5.0, {min(chunks): 2}),
            Refusal.INVALID_ARGUMENT)
        # A model of a version the leader does not hold: the member must re-join and pull.
        assert "a" not in leader.clusters and not leader.heartbeat("a", 0, 0, None).known
        chunks = member(leader, "a")
        grant = leader.request_push("a", 0, 1, 5.0, {min(chunks): 2})
        t = ticket_of(leader, grant)
        assert t == admission.Ticket(grant.round, "a", grant.push_id, 2 * TPW, 0)
        assert len(grant.push_id) == 16 and len(grant.ticket_mac) == 32
    finally:
        leader.stop()


def test_the_cluster_reads_the_leaders_tokens_off_its_grant(tmp_path):
    """Review F9: T_j as the leader counts it (the ledger's 2 windows, not the claim of 10**9),
    read off the grant's ticket; nothing for an empty, malformed or out-of-range ticket."""
    leader, _ = make_leader(tmp_path)
    try:
        chunks = member(leader, "a")
        grant = leader.request_push("a", 0, 10**9, 5.0, {min(chunks): 2})
        assert admission.granted_tokens(grant.ticket) == 2 * TPW
    finally:
        leader.stop()
    for body in ("", "[1]", "{", '{"tokens": 0}', '{"tokens": true}', '{"tokens": 1.5}',
                 '{"tokens": %d}' % 2**63, None, '{"tokens": 1, "x": "%s"}' % ("y" * 600)):
        assert admission.granted_tokens(body) is None, body


def test_a_push_sent_ahead_gets_a_ticket_of_round_0_for_its_push_id(tmp_path):
    clock = ManualClock()
    leader, _ = make_leader(tmp_path, ledger=False, clock=clock)
    try:
        member(leader, "fast")
        member(leader, "slow")
        grant = leader.request_push("fast", 0, 1, 5.0)
        assert leader.push_done("fast", grant.push_id, True, "", 30.0).verdict.accepted
        clock.advance(1.0)
        wait_for(lambda: leader.phase == "idle", "round ended")
        ahead = leader.request_push("slow", leader.version, 1, 5.0, expected_s=100.0)
        assert ahead.stage_first and ahead.round == 0
        assert ticket_of(leader, ahead) == admission.Ticket(0, "slow", ahead.push_id, 1, 1)
    finally:
        leader.stop()


def test_a_leader_restarted_mid_round_never_reuses_a_round_number(tmp_path):
    leader, _ = make_leader(tmp_path)
    granted = []
    try:
        chunks = member(leader, "a")
        granted.append(leader.request_push("a", 0, 1, 5.0, {min(chunks): 2}).round)
    finally:
        leader.stop()  # it dies mid-round: nothing is written after the grant
    again, _ = make_leader(tmp_path)
    try:
        assert again.rounds >= max(granted)
        chunks = member(again, "a")
        grant = again.request_push("a", 0, 1, 5.0, {min(chunks): 2})
        assert grant.round > max(granted)
        assert ticket_of(again, grant).round == grant.round
    finally:
        again.stop()


# ----- durability (issue input 7) ------------------------------------------------------------
def test_leader_json_and_its_directory_are_fsynced(tmp_path, fsynced):
    from dips.node.leader import data_secret, next_term

    leader = Leader(LeaderConfig(followers=1), connect=lambda e: None, run_dir=tmp_path)
    seen = fsynced
    seen.clear()  # the leader's own start
    leader.checkpoint()
    assert seen == [str(tmp_path / ".leader.json.tmp"), str(tmp_path)]
    assert json.loads((tmp_path / "leader.json").read_text())["version"] == 0
    seen.clear()
    next_term(tmp_path)
    data_secret(tmp_path)
    assert seen.count(str(tmp_path)) == 2  # the term's rename and the secret's creation


# ----- every field is checked before use (issue input 1, at the leader) ----------------------
def _aborted(call) -> Aborted:
    with pytest.raises(Aborted) as info:
        call()
    return info.value


def test_malformed_fields_are_refused_naming_the_field_with_a_short_message(tmp_path):
    leader, _ = make_leader(tmp_path)
    servicer = LeaderServicer(leader, None)
    ctx = FakeContext("cluster-a")
    try:
        member(leader, "a")
        cases = {
            "expected_push_s": pb.PushRequest(tokens=1, expected_push_s=math.nan),
            "progress": pb.PushRequest(tokens=1, progress=[pb.ChunkPos(chunk=i, position=1)
                                                           for i in range(5000)]),
            "base_version": pb.PushRequest(tokens=1, base_version=-1),
            "tokens": pb.PushRequest(tokens=0),
        }
        for field, request in cases.items():
            e = _aborted(lambda: servicer.RequestPush(request, ctx))
            assert e.refusal is Refusal.INVALID_ARGUMENT and field in e.details, (field, e)
        e = _aborted(lambda: servicer.PushDone(pb.PushDoneRequest(push_id="zz"), ctx))
        assert e.refusal is Refusal.INVALID_ARGUMENT and "push_id" in e.details
        e = _aborted(lambda: servicer.Lease(pb.LeaseRequest(n=-1), ctx))
        assert e.refusal is Refusal.INVALID_ARGUMENT and "'n'" in e.details
        e = _aborted(lambda: servicer.PullDone(pb.PullDoneRequest(version=-2), ctx))
        assert e.refusal is Refusal.INVALID_ARGUMENT
        e = _aborted(lambda: servicer.JoinCluster(pb.JoinRequest(
            stages=[pb.StageLayers(layers=["l0", "x" * 100_000])]), ctx))
        assert e.refusal is Refusal.INVALID_ARGUMENT and len(e.details) <= MAX_DETAILS + 40
        e = _aborted(lambda: servicer.Heartbeat(pb.HeartbeatRequest(cluster_id="b" * 100_000), ctx))
        assert e.refusal is Refusal.FORBIDDEN and len(e.details) <= MAX_DETAILS + 40
        assert servicer.GetStatus(pb.StatusRequest(), FakeContext("admin")).phase == "idle"
    finally:
        leader.stop()


def test_a_pull_reported_of_a_version_ahead_of_the_leaders_is_refused_and_changes_nothing(
        tmp_path):
    """It was ignored but answered ok (issue 13): a member may report only what it can hold."""
    leader, _ = make_leader(tmp_path)
    servicer = LeaderServicer(leader, None)
    ctx = FakeContext("cluster-a")
    try:
        member(leader, "a")
        leader.pull_done("a", 0)
        entry, state = leader.clusters["a"], leader._state
        before = (entry.pulled_version, entry.floor_version)
        for version in (1, 5, INT64_MAX):
            e = _aborted(lambda: servicer.PullDone(pb.PullDoneRequest(version=version), ctx))
            assert e.refusal is Refusal.INVALID_ARGUMENT
            assert f"'version' = {version}" in e.details and "ahead of the leader's 0" in e.details
        assert (entry.pulled_version, entry.floor_version) == before == (0, 0)
        assert leader._state is state  # no event reached the round machine
        assert servicer.PullDone(pb.PullDoneRequest(version=0), ctx).ok  # its own: still ok
    finally:
        leader.stop()


def test_a_lease_is_capped_at_what_an_honest_member_holds(tmp_path):
    leader, _ = make_leader(tmp_path, lease_ahead=2, max_push_tokens=10 * TPW)  # 1 chunk/push
    try:
        leader.join_cluster("hog", [["l0", "l1"]])
        held, _, _ = leader.lease("hog", 2**31 - 1)
        assert len(held) == 2 + 1 + 1  # lease_ahead + one push's chunks + one in progress
        assert len(leader.lease("hog", 5)[0]) == 4  # asking again gets nothing more
        leader.join_cluster("b", [["l0", "l1"]])
        assert len(leader.lease("b", 2)[0]) == 2  # the others still get data
    finally:
        leader.stop()


def test_a_follower_registration_with_bad_fields_is_refused(tmp_path):
    leader, _ = make_leader(tmp_path)
    servicer = LeaderServicer(leader, lambda i: FollowerEntry(
        i.index, i.data_endpoint, i.control_endpoint, list(i.layers), list(i.layer_bytes)))
    ctx = FakeContext("follower-0")
    good = pb.FollowerInfo(index=0, data_endpoint="tcp://127.0.0.1:1", layers=["l0", "l1"],
                           layer_bytes=[4, 4])
    try:
        bad = {"layer_bytes": replace_field(good, layer_bytes=[4]),
               "data_endpoint": replace_field(good, data_endpoint="tcp://a b"),
               "prepared_version": replace_field(good, prepared_version=-2),
               "checkpoints": replace_field(good, checkpoints=[-1])}
        for field, info in bad.items():
            e = _aborted(lambda: servicer.RegisterFollower(info, ctx))
            assert e.refusal is Refusal.INVALID_ARGUMENT and field in e.details, (field, e)
        e = _aborted(lambda: servicer.RegisterFollower(replace_field(good, index=5),
                                                       FakeContext("follower-5")))
        assert e.refusal is Refusal.INVALID_ARGUMENT and "index" in e.details
        servicer.RegisterFollower(good, ctx)
        assert leader.followers[0].up
    finally:
        leader.stop()


def replace_field(msg, **fields):
    out = type(msg)()
    out.CopyFrom(msg)
    for name, value in fields.items():
        if isinstance(value, list):
            del getattr(out, name)[:]
            getattr(out, name).extend(value)
        else:
            setattr(out, name, value)
    return out



# ----- a push reported delivered but incomplete (review 14, F2) ------------------------------
def test_a_member_reporting_empty_pushes_ahead_never_stalls_a_round_again(tmp_path):
    """Review 14, F2: a member stalled a round, then reported the pushes it was sent ahead
    with as delivered at once with no data; two such reports made it look fast and it was
    admitted into a round again, to stall it again. Only a push the followers found complete
    counts as fast now: the member stays sent ahead, across a leader restart, until it
    has delivered as many as it owes."""
    clock = ManualClock()
    leader, fake = make_leader(tmp_path, ledger=False, clock=clock)
    complete: set[str] = set()  # push ids of evil's that reached the follower whole

    def score(rnd, clusters, push_ids=None, retired=None):
        whole = [c != "evil" or p in complete for c, p in zip(clusters, push_ids)]
        return [(c, ok, 1.0, "" if ok else "layers missing") for c, ok in zip(clusters, whole)]

    fake.score = score
    try:
        member(leader, "good")
        member(leader, "evil")
        g = leader.request_push("good", 0, 1, 5.0)
        assert leader.push_done("good", g.push_id, True, "", 30.0).verdict.accepted
        wait_for(lambda: leader.phase == "idle", "round 1 ended")
        stall = leader.request_push("evil", 0, 1, 5.0, expected_s=0.0)
        assert stall.round and not stall.stage_first  # admitted; it never reports
        wait_for(lambda: leader.phase == "push", "round 2 in its push phase")
        clock.advance(3.0)  # its deadline: 2 s + 4 × good's measured 0 s
        wait_for(lambda: leader.phase == "idle", "round 2 timed out")
        assert leader._state.push_s["evil"] == 3.0
        for k in range(4):
            ahead = leader.request_push("evil", leader.version, 1, 5.0, expected_s=0.0)
            assert ahead.stage_first and ahead.round == 0, k  # never held a round again
            reply = leader.push_done("evil", ahead.push_id, True, "", 30.0)
            assert not reply.verdict.accepted and "layers missing" in reply.verdict.reason
            g = leader.request_push("good", leader.version, 1, 5.0)
            assert g.round and leader.push_done("good", g.push_id, True, "", 30.0).verdict.accepted
            wait_for(lambda: leader.phase == "idle", "good's round ended")
        # 5 incomplete pushes: it owes 2**4 complete ones (review 17, C: owed doubles).
        assert leader._state.send_ahead == {"evil": 16} and leader._state.push_s["evil"] == 3.0
        leader.checkpoint()
    finally:
        leader.stop()
    again, fake = make_leader(tmp_path, ledger=False, clock=clock)
    fake.score = score
    try:
        assert again._state.send_ahead == {"evil": 16} and again._state.stalls == {"evil": 5}
        member(again, "evil")
        ahead = again.request_push("evil", again.version, 1, 5.0, expected_s=0.0)
        assert ahead.stage_first
        complete.add(ahead.push_id)
        clock.advance(0.5)
        assert again.push_done("evil", ahead.push_id, True, "", 30.0).verdict.accepted
        assert again._state.send_ahead == {"evil": 15}  # one paid off
        assert again._state.push_s["evil"] == 3.0  # and its estimate holds while it owes
    finally:
        again.stop()


def test_an_abandoned_wait_for_a_verdict_says_how_long_it_waited(tmp_path):
    """Review 34, F2: a client gone after about a second was logged "undecided after
    39.899 s", the limit instead of the time waited."""
    clock = ManualClock()
    leader, _ = make_leader(tmp_path, clock=clock, window_s=5.0)
    try:
        ca, _ = member(leader, "a"), member(leader, "b")
        ga = leader.request_push("a", 0, 3 * TPW, 5.0, {min(ca): 3})
        message = refused(lambda: leader.push_done("a", ga.push_id, True, "", 39.899,
                                                   cancelled=lambda: True), Refusal.UNDECIDED)
        assert message.endswith("undecided after 0.0 s"), message
    finally:
        leader.stop()
