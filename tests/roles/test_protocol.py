"""The Di-PS protocol in one process: real leader gRPC service, real follower ZeroMQ servers,
real ClusterClients in threads; checks the outer step against torch.optim.SGD(nesterov=True)
and that bad pushes never change θ (§5, §6, §8 of the seed).

No assertion depends on timing (which thread's request arrives first, whether it lands
inside a 0.3 s window, how long a pull takes): clusters that must share a round are admitted
while the leader's clock is held (:meth:`Run.one_round`), and a slow pull is one the test holds
back until the event it waits for has happened.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dips.algo import PenaltyConfig
from dips.algo.refusal import Refusal
from dips.algo.round import slot_of
from dips.roles.client import ClusterClient
from dips.roles.cluster import fetch_global_model
from dips.roles.leader import Leader, LeaderConfig
from dips.spec import GraceConfig, MembershipConfig, ModelConfig, OuterConfig, Timeouts
from dips.train.dips_sync import push_record
from dips.train.model import build_model
from dips.wire.admission import Ticket, admission_key, sign
from dips.wire.control import refusal_of
from dips.wire.dataplane import DataClient, DataPlaneError
from dips.wire.keys import MemberKey, issue
from dips.wire.pb import control_pb2 as pb
from dips.wire.pb import control_pb2_grpc as pbg
from dips.wire.pki import Identity
from dips.wire.security import Credentials
from dips.wire.services import leader_client
from tests.roles.inprocess import add_followers, serve_leader

pytestmark = pytest.mark.timeout(120)

CFG = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, vocab_size=512, max_seq_len=64)


def _wait_until(cond, what: str, timeout_s: float = 60.0):
    """Poll ``cond`` until it returns a true value (returned); fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what}: not within {timeout_s} s")


class HeldClock:
    """The leader's clock: monotonic, except that it stands still while held.

    A grace window opened while the clock is held cannot close before :meth:`release`, so
    requests sent meanwhile join the same round however slowly their threads run (the
    window's length is unchanged; heartbeats cannot expire meanwhile either).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held_at: float | None = None
        self._offset = 0.0

    def __call__(self) -> float:
        with self._lock:
            return self._held_at if self._held_at is not None else time.monotonic() - self._offset

    def hold(self) -> None:
        with self._lock:
            if self._held_at is None:
                self._held_at = time.monotonic() - self._offset

    def release(self) -> None:
        with self._lock:
            if self._held_at is not None:
                self._offset = time.monotonic() - self._held_at
                self._held_at = None


class Run:
    """Leader + 2 followers served on loopback inside this process."""

    def __init__(self, tmp_path, grace_s: float = 0.3, penalty: PenaltyConfig | None = None,
                 pull_barrier: bool = False, max_outer_steps: int | None = None,
                 outer: OuterConfig | None = None,
                 membership: MembershipConfig | None = None,
                 max_push_tokens: int | None = None):
        self.model0 = build_model(CFG, seed=0)
        self.shards, self.servers = [], []
        # No test here is about failure detection: heartbeats may be late on a loaded machine
        # without anybody being removed (30 missed intervals, not 3).
        cfg = LeaderConfig(grace=GraceConfig(window_s=grace_s, pull_barrier=pull_barrier),
                           timeouts=Timeouts(push_s=60, pull_s=60),
                           membership=membership or MembershipConfig(
                               heartbeat_interval_s=1.0, missed_heartbeats=30),
                           followers=2, penalty=penalty or PenaltyConfig(),
                           max_outer_steps=max_outer_steps, outer=outer or OuterConfig(),
                           max_push_tokens=max_push_tokens)
        self.clock = HeldClock()
        self.admitted: dict[str, list[int]] = {}  # cluster id -> rounds it was admitted to
        self.leader = Leader(cfg, connect=lambda e: self.shards[e.index], run_dir=tmp_path,
                             clock=self.clock)
        real_request = self.leader.request_push

        def request_push(cluster_id, *args, **kwargs):  # what the gRPC service calls
            grant = real_request(cluster_id, *args, **kwargs)
            self.admitted.setdefault(cluster_id, []).append(grant.round)
            return grant

        self.leader.request_push = request_push
        self.secret = self.leader.issued.data_secret  # the leader's (random) data secret
        self.entries = add_followers(self.leader, self.model0, tmp_path, 2, self.shards,
                                     self.servers)
        # In-process followers heartbeat like follower processes do (else down after 3 s).
        self._beating = threading.Event()
        self._beat = threading.Thread(target=self._heartbeats, daemon=True)
        self._beat.start()
        self.grpc, self.addr = serve_leader(self.leader)
        self.leader.start()
        _wait_until(lambda: self.leader.ready, "followers reconciled")

    def client(self, cid: str, stages: int = 1, wire_dtype: str = "bf16") -> ClusterClient:
        return ClusterClient(build_model(CFG, seed=1), self.addr, cid,
                             Credentials.insecure(Identity.cluster(cid)), H=2,
                             stages=stages, timeout_s=60, admit_timeout_s=60,
                             heartbeat_interval_s=0.2, wire_dtype=wire_dtype)

    def key(self, identity: Identity) -> MemberKey:
        """A data-plane key the leader would issue ``identity`` (at a join)."""
        return issue(self.secret, identity, False)

    def one_round(self, jobs: dict[str, object]) -> dict[str, threading.Thread]:
        """Start ``jobs`` (cluster id -> a call that makes that cluster push) in threads, all
        admitted into one round: the leader's clock stands still until every one of them was
        admitted, so the window cannot close on a request whose thread is merely slow.
        Returns the threads (started, not joined)."""
        before = {c: len(self.admitted.get(c, [])) for c in jobs}
        self.clock.hold()
        try:
            threads = {c: threading.Thread(target=job, daemon=True) for c, job in jobs.items()}
            for t in threads.values():
                t.start()
            _wait_until(lambda: all(len(self.admitted.get(c, [])) > before[c] for c in jobs),
                        f"clusters {sorted(jobs)} admitted")
        finally:
            self.clock.release()
        rounds = {self.admitted[c][before[c]] for c in jobs}
        assert len(rounds) == 1, f"admitted to different rounds: {rounds}"
        return threads

    def _heartbeats(self) -> None:
        while not self._beating.wait(0.3):
            for e in self.entries:
                self.leader.register_follower(e)

    def close(self):
        self._beating.set()
        self._beat.join(5)
        self.leader.stop()
        self.grpc.stop(0)
        for s in self.servers:
            s.stop()


@pytest.fixture
def run(tmp_path):
    r = Run(tmp_path)
    yield r
    r.close()


def _perturb(model, seed, scale=1e-2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def _two_trained(run):
    """Clusters a and b joined, each with its model moved from the version it pulled."""
    a, b = run.client("a"), run.client("b")
    a.join()
    b.join()
    _perturb(a.model, 1)
    _perturb(b.model, 2)
    return a, b


def _sync_all(run, clients, tokens):
    """Every client finishes H = 2 inner steps and syncs; all in one round."""
    results = {}

    def go(c, t):
        c.step_done(t)
        results[c.cluster_id] = c.step_done(t)

    threads = run.one_round({c.cluster_id: (lambda c=c, t=t: go(c, t))
                             for c, t in zip(clients, tokens)})
    for t in threads.values():
        t.join(90)
        assert not t.is_alive(), "a sync did not finish"
    return results


@pytest.mark.parametrize("wire_dtype", ["bf16", "fp32"])
def test_join_pulls_the_global_model(run, wire_dtype):
    c = run.client("a", stages=2, wire_dtype=wire_dtype)
    assert c.join() == 0
    for (n, p), (_, q) in zip(c.model.named_parameters(), run.model0.named_parameters()):
        want = q.detach() if wire_dtype == "fp32" else q.detach().to(torch.bfloat16).float()
        assert torch.equal(p.detach(), want), n  # outer.wire_dtype fp32: θ exactly
    c.close()


@pytest.fixture(params=["relative", "seed"])
def clip_run(request, tmp_path):
    r = Run(tmp_path, outer=OuterConfig(clip=request.param))
    yield r
    r.close()


def test_one_outer_step_equals_sgd_nesterov(clip_run):
    run = clip_run
    clients = [run.client("a", stages=2), run.client("b")]
    for c in clients:
        c.join()
    locals_ = {}
    for i, c in enumerate(clients):
        _perturb(c.model, seed=10 + i)
        locals_[c.cluster_id] = {n: p.detach().to(torch.bfloat16).float()
                                 for n, p in c.model.named_parameters()}
    results = _sync_all(run, clients, [100, 300])
    assert all(r.accepted and r.version == 1 for r in results.values()), results
    # Reference: Δ_j = θ0 − θ_j, δ = token-weighted mean, clipped, SGD(nesterov). The seed's
    # clip: to norm 1 (§8); the relative one: to 0.4·√μ, μ the §8 EMA of ‖Δ_j‖², which in the
    # warm-up is the plain mean of the two pushes' squared norms.
    ref = {n: p.detach().clone().requires_grad_(True) for n, p in run.model0.named_parameters()}
    delta = {n: 0.25 * (ref[n].detach() - locals_["a"][n]) + 0.75 * (ref[n].detach() - locals_["b"][n])
             for n in ref}
    norm = torch.sqrt(sum((d.double() ** 2).sum() for d in delta.values())).item()
    sq = {c: sum(((ref[n].detach() - x[n]).double() ** 2).sum().item() for n in ref)
          for c, x in locals_.items()}
    threshold = 1.0 if run.leader.cfg.outer.clip == "seed" else 0.4 * ((sq["a"] + sq["b"]) / 2) ** 0.5
    clip = min(1.0, threshold / norm)
    assert clip < 1.0  # the clip binds in both modes here
    opt = torch.optim.SGD(list(ref.values()), lr=0.7, momentum=0.8, nesterov=True)
    for n, p in ref.items():
        p.grad = delta[n] * clip
    opt.step()
    got = build_model(CFG, seed=5)
    fetch_global_model(got, [pb.FollowerInfo(index=s.index, data_endpoint=srv.endpoint,
                                             layers=list(s.layers))
                             for s, srv in zip(run.shards, run.servers)], 1,
                       run.key(Identity.admin()))  # an observer's key, as a final pull has
    for n, p in got.named_parameters():
        torch.testing.assert_close(p.detach(), ref[n].detach(), rtol=1e-6, atol=1e-7)
    # Both clusters now hold version 1 (as BF16 on the wire): the followers' θ rounded.
    theta = dict(got.named_parameters())
    for c in clients:
        assert c.version == 1
        for n, p in c.model.named_parameters():
            assert torch.equal(p.detach(), theta[n].detach().to(torch.bfloat16).float())
        c.close()


def _admitted(run, cluster: str, rnd: int, push_id: str) -> dict:
    """A push header carrying a ticket as the leader signs it (dips.wire.admission)."""
    body, mac = sign(admission_key(run.secret), Ticket(rnd, cluster, push_id, 128, 0))
    return {"op": "push", "cluster": cluster, "round": rnd, "push_id": push_id,
            "ticket": body, "ticket_mac": mac.hex()}


def test_nan_and_misshaped_pushes_never_change_theta(run):
    before = [s.state()[2] for s in run.shards]
    client = DataClient(run.key(Identity.cluster("x")), run.servers[0].endpoint, timeout_s=10)
    layer = next(iter(run.shards[0].layers))
    names = run.shards[0].layers[layer]
    bad = [(n, torch.full_like(run.shards[0].params[n], float("nan")).to(torch.bfloat16))
           for n in names]
    head = {**_admitted(run, "x", 1, "00000000000000aa"), "layer": layer}
    with pytest.raises(DataPlaneError, match="NaN") as info:
        client.request(head, bad)
    assert info.value.code is Refusal.INVALID_ARGUMENT
    wrong = [(n, torch.zeros(3, 3, dtype=torch.bfloat16)) for n in names]
    with pytest.raises(DataPlaneError, match="shape"):
        client.request(head, wrong)
    good = [(n, run.shards[0].params[n].to(torch.bfloat16)) for n in names]
    with pytest.raises(DataPlaneError, match="ticket") as info:  # not admitted by the leader
        client.request({"op": "push", "cluster": "x", "round": 1, "push_id": "00000000000000aa",
                        "layer": layer}, good)
    assert info.value.code is Refusal.FORBIDDEN
    with pytest.raises(DataPlaneError, match="version"):
        client.request({"op": "pull", "version": 7, "layers": [layer]})
    client.close()
    # A cluster whose push is refused on one shard is rejected on every shard; θ unchanged.
    norms = run.shards[0].score(1, ["x"])
    assert norms[0][1] is False
    assert [s.state()[2] for s in run.shards] == before


def test_a_cluster_cannot_push_as_another_on_the_data_plane(run):
    """A data-plane key names the member it was issued to: a push naming another cluster is
    refused (FORBIDDEN) and stages nothing; the follower keeps serving."""
    layer = next(iter(run.shards[0].layers))
    local = [(n, run.shards[0].params[n].to(torch.bfloat16)) for n in run.shards[0].layers[layer]]
    client = DataClient(run.key(Identity.cluster("a")), run.servers[0].endpoint, timeout_s=10)
    with pytest.raises(DataPlaneError, match="cluster-a") as info:
        client.request({"op": "push", "cluster": "b", "round": 1, "push_id": "p",
                        "layer": layer}, local)
    assert info.value.code is Refusal.FORBIDDEN
    with pytest.raises(DataPlaneError) as info:  # a stream is refused the same way
        client.push({"op": "push", "cluster": "b", "round": 1, "push_id": "p", "layer": layer},
                    local, chunk_bytes=1024)
    assert info.value.code is Refusal.FORBIDDEN
    assert run.shards[0].score(1, ["b"])[0][1] is False  # nothing staged for "b"
    got = [(n, torch.empty_like(t)) for n, t in local]
    client.pull({"op": "pull", "version": 0, "layers": [layer]}, got, chunk_bytes=1024)
    client.close()


def test_a_control_call_as_another_cluster_is_refused(run):
    import grpc

    c = run.client("a")
    c.join()
    bad = leader_client(run.addr, Credentials.insecure(Identity.cluster("b")), timeout_s=5)
    with pytest.raises(grpc.RpcError) as exc:
        bad.Heartbeat(pb.HeartbeatRequest(cluster_id="a"))
    assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refusal_of(exc.value) is Refusal.FORBIDDEN
    bad.close()
    # Only a cluster may act as one (the operator's identity reads the status, nothing more).
    admin = leader_client(run.addr, Credentials.insecure(Identity.admin()), timeout_s=5)
    assert admin.GetStatus(pb.StatusRequest()).followers_ready == 2
    with pytest.raises(grpc.RpcError) as exc:
        admin.Heartbeat(pb.HeartbeatRequest(cluster_id="a"))
    assert refusal_of(exc.value) is Refusal.FORBIDDEN
    admin.close()
    # A call that claims no identity at all is refused.
    channel = grpc.insecure_channel(run.addr)
    with pytest.raises(grpc.RpcError) as exc:
        pbg.LeaderStub(channel).GetStatus(pb.StatusRequest(), timeout=5)
    assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refusal_of(exc.value) is Refusal.FORBIDDEN
    channel.close()
    c.close()


def test_a_cluster_records_the_tokens_the_leader_counts_not_its_claim(tmp_path):
    """Review F9: a cluster that claims 10**6 tokens per inner step, where the leader counts
    at most 150 a push (``max_push_tokens``; with a ledger: its windows), sees the leader's
    T_j in its own SyncResult (its step_done record and log line), not its claim."""
    r = Run(tmp_path, max_push_tokens=150)
    try:
        a, b = _two_trained(r)
        results = _sync_all(r, [a, b], [10**6, 10**6])
        assert all(x.accepted for x in results.values())
        assert [results[c].tokens for c in "ab"] == [150, 150]
        assert push_record(results["a"])["tokens"] == 150
        a.close()
        b.close()
    finally:
        r.close()


def test_the_run_ends_at_its_limit_and_every_member_is_told(tmp_path):
    """A hand-deployed run used to go on for ever (found by a review): the leader itself ends
    it at the token budget, outer-step or time limit (dips.algo.limits), after the round in
    flight; then pushes and joins are refused, heartbeats say so, and a restart stays ended."""
    r = Run(tmp_path, max_outer_steps=1)
    try:
        a, b = _two_trained(r)
        results = _sync_all(r, [a, b], [100, 100])
        assert all(x.accepted for x in results.values())
        _wait_until(lambda: r.leader.status().finished, "the run finished")
        assert r.leader.status().finished == "max outer steps" and r.leader.version == 1
        theta = {n: p.clone() for s in r.shards for n, p in s.params.items()}
        a.step_done(100)
        res = a.step_done(100)  # the next push is refused: the client stops, not a failure
        assert not res.ok and a.finished == "the run finished (max outer steps) at version 1"
        _wait_until(lambda: b.finished, "b told by its heartbeat")
        lc = leader_client(r.addr, Credentials.insecure(Identity.cluster("c")), timeout_s=5)
        import grpc
        with pytest.raises(grpc.RpcError) as exc:
            lc.JoinCluster(pb.JoinRequest(cluster_id="c"))
        assert refusal_of(exc.value) is Refusal.RUN_FINISHED
        assert lc.GetStatus(pb.StatusRequest()).finished == "max outer steps"
        lc.close()
        assert all(torch.equal(p, theta[n]) for s in r.shards for n, p in s.params.items())
        a.close()
        b.close()
    finally:
        r.close()
    again = Leader(LeaderConfig(followers=2), connect=lambda e: None, run_dir=tmp_path)
    assert again.status().finished == "max outer steps"  # persisted in leader.json


def test_a_push_queued_when_the_limit_is_reached_gets_no_round(tmp_path):
    """Found by a review: a push queued during the update that reached max_outer_steps opened
    one more round (the limit was checked only after the machine opened it)."""
    r = Run(tmp_path, max_outer_steps=1)
    try:
        a, b = r.client("a"), r.client("b")
        a.join()
        b.join()
        entered, gate = threading.Event(), threading.Event()
        apply = r.shards[0].apply

        def held_apply(*args, **kwargs):  # round 1's update waits here
            entered.set()
            gate.wait(60)
            return apply(*args, **kwargs)

        r.shards[0].apply = held_apply
        results = {}
        ta = threading.Thread(target=lambda: (a.step_done(100), results.setdefault(
            "a", a.step_done(100))), daemon=True)
        ta.start()
        assert entered.wait(60)
        tb = threading.Thread(target=lambda: (b.step_done(100), results.setdefault(
            "b", b.step_done(100))), daemon=True)
        tb.start()
        _wait_until(lambda: (s := slot_of(r.leader._state, "b")) is not None and s.round is None,
                    "b's request queued during round 1's update")
        gate.set()
        ta.join(60)
        tb.join(60)
        assert results["a"].accepted and not results["b"].ok
        assert b.finished.startswith("the run finished (max outer steps)")
        assert r.leader.rounds == 1 and r.leader.version == 1
        a.close()
        b.close()
    finally:
        r.close()


def test_stale_and_invalid_push_requests_are_refused(run):
    import grpc

    c = run.client("a")
    c.join()
    lc = leader_client(run.addr, Credentials.insecure(Identity.cluster("a")), timeout_s=5)
    with pytest.raises(grpc.RpcError) as exc:
        lc.RequestPush(pb.PushRequest(cluster_id="a", base_version=-1, tokens=10))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "base_version" in exc.value.details()
    nobody = leader_client(run.addr, Credentials.insecure(Identity.cluster("nobody")),
                           timeout_s=5)
    with pytest.raises(grpc.RpcError) as exc:  # a cluster that never joined
        nobody.RequestPush(pb.PushRequest(cluster_id="nobody", base_version=0, tokens=10))
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refusal_of(exc.value) is Refusal.NOT_JOINED
    nobody.close()
    with pytest.raises(grpc.RpcError) as exc:
        lc.RequestPush(pb.PushRequest(cluster_id="a", base_version=0, tokens=0))
    assert "tokens" in exc.value.details()
    lc.close()
    c.close()


@pytest.mark.parametrize("barrier", [False, True])
def test_a_slow_pull_delays_only_its_own_cluster(tmp_path, barrier):
    """Without the pull barrier the next round opens while a slow cluster still pulls: a fast
    cluster completes another outer step meanwhile, and the slow one still receives its whole
    version intact (from the followers' snapshot). With the barrier (the seed's §6 round) the
    fast cluster's next step waits for that pull.

    The slow link is a pull the test holds back (not a sleep): without the barrier it is
    released only after the fast cluster's second outer step, so that step provably ran while
    the slow cluster was still pulling; with the barrier the fast cluster's next request is
    seen queued behind the unfinished pull before the pull is let go."""
    run = Run(tmp_path, grace_s=0.5, pull_barrier=barrier)
    pulled_at, pulling, release = {}, threading.Event(), threading.Event()
    try:
        slow, fast = run.client("slow"), run.client("fast")
        for c in (slow, fast):
            c.join()
        real_pull = slow._pull

        def slow_pull(version):
            pulling.set()
            assert release.wait(90), "the held pull was never released"
            real_pull(version)
            pulled_at[version] = time.monotonic()

        slow._pull = slow_pull
        for i, c in enumerate((slow, fast)):
            _perturb(c.model, seed=20 + i)
        first = {}
        threads = run.one_round({
            "slow": lambda: first.update(slow=(slow.step_done(100), slow.step_done(100))),
            "fast": lambda: first.update(fast=(fast.step_done(100), fast.step_done(100)))})
        threads["fast"].join(90)
        assert "fast" in first, "the fast cluster's first sync did not finish"
        assert first["fast"][1].accepted and first["fast"][1].version == 1, first["fast"][1]
        assert pulling.wait(90), "the slow cluster never started its pull"
        v1 = {n: p.detach().clone() for n, p in fast.model.named_parameters()}
        _perturb(fast.model, seed=30)
        fast.step_done(100)
        second = {}
        fast_thread = threading.Thread(target=lambda: second.update(r=fast.step_done(100)),
                                       daemon=True)
        fast_thread.start()
        if barrier:
            # The fast cluster's request is queued behind round 1, whose pull is not done.
            def queued():
                slot = slot_of(run.leader._state, "fast")
                return slot is not None and slot.round is None

            _wait_until(queued, "the fast cluster's second request queued")
            assert run.leader.phase == "pull" and run.leader.rounds == 1
            assert 1 not in pulled_at and not second
            release.set()
        fast_thread.join(90)
        fast_done = time.monotonic()
        assert "r" in second, "the fast cluster's second sync did not finish"
        assert second["r"].accepted and second["r"].version == 2, second["r"]
        if not barrier:
            assert 1 not in pulled_at  # version 2 exists while version 1 is still being pulled
            release.set()
        threads["slow"].join(90)
        res = first["slow"][1]
        assert res.ok and res.version == 1, res  # the slow cluster got version 1, not a mix
        for n, p in slow.model.named_parameters():
            assert torch.equal(p.detach(), v1[n]), n
        assert (fast_done > pulled_at[1]) == barrier
        for c in (slow, fast):
            c.close()
    finally:
        release.set()
        run.close()
