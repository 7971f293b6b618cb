"""The Di-PS protocol in one process: real leader gRPC service, real follower ZeroMQ servers,
real ClusterClients in threads; checks the outer step against torch.optim.SGD(nesterov=True)
and that bad pushes never change θ (§5, §6, §8 of the seed)."""

from __future__ import annotations

import secrets
import threading
import time

import pytest
import torch

from dips.algo import PenaltyConfig, partition_contiguous
from dips.roles.client import ClusterClient
from dips.roles.cluster import fetch_global_model
from dips.roles.follower import FollowerShard
from dips.roles.leader import FollowerEntry, Leader, LeaderConfig
from dips.train.model import ModelConfig, build_model, layer_table
from dips.wire.control import make_server
from dips.wire.dataplane import DataClient, DataPlaneError, DataServer
from dips.wire.pb import control_pb2 as pb
from dips.wire.pb import control_pb2_grpc as pbg
from dips.wire.services import LeaderServicer, leader_client

pytestmark = pytest.mark.timeout(120)

CFG = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, vocab_size=512, max_seq_len=64)


class Run:
    """Leader + 2 followers served on loopback inside this process."""

    def __init__(self, tmp_path, grace_s: float = 0.3, penalty: PenaltyConfig | None = None,
                 pull_barrier: bool = False):
        self.secret = secrets.token_hex(32)
        self.key = bytes.fromhex(self.secret)
        self.model0 = build_model(CFG, seed=0)
        table = layer_table(self.model0)
        params = {n: p.detach().clone() for n, p in self.model0.named_parameters()}
        parts = partition_contiguous([b for _, _, b in table], 2)
        self.shards, self.servers, self.entries = [], [], []
        cfg = LeaderConfig(grace_window_s=grace_s, push_timeout_s=20, pull_timeout_s=20,
                           followers=2, penalty=penalty or PenaltyConfig(),
                           pull_barrier=pull_barrier)
        self.leader = Leader(cfg, connect=lambda e: self.shards[e.index], run_dir=tmp_path)
        for i, r in enumerate(parts):
            layers = {table[j][0]: table[j][1] for j in r}
            shard = FollowerShard(i, layers, params, log_dir=tmp_path / f"f{i}")
            server = DataServer(self.key, shard.handle).start()
            self.shards.append(shard)
            self.servers.append(server)
            self.entries.append(FollowerEntry(i, server.endpoint, "", list(layers),
                                              [table[j][2] for j in r]))
            self.leader.register_follower(self.entries[-1])
        # In-process followers heartbeat like follower processes do (else down after 3 s).
        self._beating = threading.Event()
        self._beat = threading.Thread(target=self._heartbeats, daemon=True)
        self._beat.start()
        self.grpc = make_server(self.secret, max_workers=16)
        pbg.add_LeaderServicer_to_server(LeaderServicer(self.leader, None), self.grpc)
        self.addr = f"127.0.0.1:{self.grpc.add_insecure_port('127.0.0.1:0')}"
        self.grpc.start()
        self.leader.start()
        deadline = time.monotonic() + 20
        while not self.leader.ready and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.leader.ready, "followers were not reconciled"

    def client(self, cid: str, stages: int = 1) -> ClusterClient:
        return ClusterClient(build_model(CFG, seed=1), self.addr, cid, self.secret, H=2,
                             stages=stages, timeout_s=30, heartbeat_interval_s=0.2)

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


def _sync_all(clients, tokens):
    results = {}

    def go(c, t):
        c.step_done(t)
        results[c.cluster_id] = c.step_done(t)

    threads = [threading.Thread(target=go, args=(c, t)) for c, t in zip(clients, tokens)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_join_pulls_the_global_model(run):
    c = run.client("a", stages=2)
    assert c.join() == 0
    for (n, p), (_, q) in zip(c.model.named_parameters(), run.model0.named_parameters()):
        assert torch.equal(p.detach(), q.detach().to(torch.bfloat16).float()), n
    c.close()


def test_one_outer_step_equals_sgd_nesterov(run):
    clients = [run.client("a", stages=2), run.client("b")]
    for c in clients:
        c.join()
    locals_ = {}
    for i, c in enumerate(clients):
        _perturb(c.model, seed=10 + i)
        locals_[c.cluster_id] = {n: p.detach().to(torch.bfloat16).float()
                                 for n, p in c.model.named_parameters()}
    results = _sync_all(clients, [100, 300])
    assert all(r.accepted and r.version == 1 for r in results.values()), results
    # Reference: Δ_j = θ0 − θ_j, δ = token-weighted mean, clip to norm 1, SGD(nesterov).
    ref = {n: p.detach().clone().requires_grad_(True) for n, p in run.model0.named_parameters()}
    delta = {n: 0.25 * (ref[n].detach() - locals_["a"][n]) + 0.75 * (ref[n].detach() - locals_["b"][n])
             for n in ref}
    norm = torch.sqrt(sum((d.double() ** 2).sum() for d in delta.values())).item()
    clip = min(1.0, 1.0 / norm)
    opt = torch.optim.SGD(list(ref.values()), lr=0.7, momentum=0.8, nesterov=True)
    for n, p in ref.items():
        p.grad = delta[n] * clip
    opt.step()
    got = build_model(CFG, seed=5)
    fetch_global_model(got, [pb.FollowerInfo(index=s.index, data_endpoint=srv.endpoint,
                                             layers=list(s.layers))
                             for s, srv in zip(run.shards, run.servers)], 1, run.secret)
    for n, p in got.named_parameters():
        torch.testing.assert_close(p.detach(), ref[n].detach(), rtol=1e-6, atol=1e-7)
    # Both clusters now hold version 1 (as BF16 on the wire).
    for c in clients:
        assert c.version == 1
        for n, p in c.model.named_parameters():
            assert torch.equal(p.detach(), ref[n].detach().to(torch.bfloat16).float())
        c.close()


def test_nan_and_misshaped_pushes_never_change_theta(run):
    before = [s.state()[2] for s in run.shards]
    client = DataClient(run.key, run.servers[0].endpoint, timeout_s=10)
    layer = next(iter(run.shards[0].layers))
    names = run.shards[0].layers[layer]
    bad = [(n, torch.full_like(run.shards[0].params[n], float("nan")).to(torch.bfloat16))
           for n in names]
    with pytest.raises(DataPlaneError, match="NaN"):
        client.request({"op": "push", "cluster": "x", "round": 1, "push_id": "p", "layer": layer}, bad)
    wrong = [(n, torch.zeros(3, 3, dtype=torch.bfloat16)) for n in names]
    with pytest.raises(DataPlaneError, match="shape"):
        client.request({"op": "push", "cluster": "x", "round": 1, "push_id": "p", "layer": layer},
                       wrong)
    with pytest.raises(DataPlaneError, match="version"):
        client.request({"op": "pull", "version": 7, "layers": [layer]})
    client.close()
    # A cluster whose push is refused on one shard is rejected on every shard; θ unchanged.
    norms = run.shards[0].score(1, ["x"])
    assert norms[0][1] is False
    assert [s.state()[2] for s in run.shards] == before


def test_unauthenticated_control_call_is_refused(run):
    import grpc

    bad = leader_client(run.addr, "00" * 32, timeout_s=5)
    with pytest.raises(grpc.RpcError) as exc:
        bad.GetStatus(pb.StatusRequest())
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    bad.close()


def test_stale_and_invalid_push_requests_are_refused(run):
    import grpc

    c = run.client("a")
    c.join()
    lc = leader_client(run.addr, run.secret, timeout_s=5)
    with pytest.raises(grpc.RpcError) as exc:
        lc.RequestPush(pb.PushRequest(cluster_id="a", base_version=-1, tokens=10))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "base_version" in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:
        lc.RequestPush(pb.PushRequest(cluster_id="nobody", base_version=0, tokens=10))
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
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
    fast cluster's next step waits for that pull."""
    run = Run(tmp_path, grace_s=0.5, pull_barrier=barrier)
    try:
        slow, fast = run.client("slow"), run.client("fast")
        for c in (slow, fast):
            c.join()
        pulled_at = {}
        real_pull = slow._pull

        def slow_pull(version):
            time.sleep(3.0)  # a slow link: the pull takes 3 s
            real_pull(version)
            pulled_at[version] = time.monotonic()

        slow._pull = slow_pull
        for i, c in enumerate((slow, fast)):
            _perturb(c.model, seed=20 + i)
        first = {}
        slow_thread = threading.Thread(target=lambda: first.update(slow=(slow.step_done(100),
                                                                        slow.step_done(100))))
        slow_thread.start()
        first["fast"] = (fast.step_done(100), fast.step_done(100))
        assert first["fast"][1].version == 1, first["fast"][1]
        v1 = {n: p.detach().clone() for n, p in fast.model.named_parameters()}
        _perturb(fast.model, seed=30)
        fast.step_done(100)
        second = fast.step_done(100)
        fast_done = time.monotonic()
        slow_thread.join(60)
        assert second.accepted and second.version == 2, second
        res = first["slow"][1]
        assert res.ok and res.version == 1, res  # the slow cluster got version 1, not a mix
        for n, p in slow.model.named_parameters():
            assert torch.equal(p.detach(), v1[n]), n
        assert (fast_done > pulled_at[1]) == barrier
        for c in (slow, fast):
            c.close()
    finally:
        run.close()
