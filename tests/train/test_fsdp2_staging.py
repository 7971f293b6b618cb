"""An FSDP2 cluster's stage workers stage one layer at a time (issue 14, dips.roles.cluster_shards).

Two real gloo ranks shard a 14-layer model with ``fully_shard`` and push it through
:class:`dips.roles.cluster_ranks.RankWorker` to two real followers (DataServers on loopback,
in this process); a single process holding the same full model pushes it as another cluster
in the same round. Then:

* the pushes are bit-identical: every follower formed the same Δ, bit for bit, from both;
* after the outer step, both ranks pull it back, and the sharded model gathered whole is
  the followers' new θ in the wire dtype (BF16), bit for bit;
* a pull of a version the followers do not hold fails on every rank at its first layer and
  leaves the model as it was; one rank failing its third layer stops both after the layers
  of the first two steps, and every staging buffer is free again;
* every host staging buffer either rank allocated, for the push and the pulls together
  (counted where they are allocated: ``dips.roles.cluster.host_buffer``), is at most
  ``StageWorker.depth + 1`` of its largest layers in the wire dtype — well below the rank's
  block, which the stage workers staged whole before.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(240)

SECRET = b"s" * 32
BLOCKS = 12
LAYERS = BLOCKS + 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)


class Net(nn.Module):
    """embed, 12 blocks, head (norm + projection): 14 layers of 2–4 k parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm, self.head = nn.LayerNorm(32), nn.Linear(32, 64)


def _net(perturbed: bool) -> Net:
    """The same model in every process (seed 0), moved by seeded noise (the cluster's
    local θ) when ``perturbed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = Net()
    if perturbed:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.01)
    return net


def _wait_for(path: Path, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path.name} within {limit_s} s"
        time.sleep(0.05)


def _rank(rank: int, tmp: str, setup: dict) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dips.roles import cluster
    from dips.roles import cluster_shards as shards
    from dips.roles.cluster_ranks import RankWorker, rank_blocks
    from dips.roles.layers import group_layers
    from dips.roles.rank_comm import Ranks

    allocated = []  # bytes of every host staging buffer allocated on this rank
    plain = cluster.host_buffer

    def counted(shape, dtype):
        t = plain(shape, dtype)
        allocated.append(t.numel() * t.element_size())
        return t

    cluster.host_buffer = shards.host_buffer = counted
    out = Path(tmp)
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))
    try:
        torch.set_num_threads(1)
        model = _net(perturbed=True)
        mesh = init_device_mesh("cpu", (2,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        layers = group_layers(model)
        blocks = rank_blocks([sum(p.numel() * 4 for _, p in ps) for _, ps in layers], 2)
        ranks = Ranks.control_group(rank, 2, 120.0, torch.device("cpu"))
        worker = RankWorker(ranks, layers, blocks, wire_dtype="bf16")
        assert worker.sharded
        owner = setup["owner"]
        worker.run({"op": "connect", "key_id": setup["key_id"], "key": setup["key"],
                    "encrypt": False, "timeout_s": 60.0, "endpoints": setup["endpoints"],
                    "owner": owner})
        plans = [[(layers[i][0], owner[layers[i][0]]) for i in r] for r in blocks]
        pushed = worker.run({"op": "push", "cluster": "fsdp", "round": 1,
                             "push_id": "66736470" + "00000001", "plans": plans,
                             "tokens": 100, "stage_first": False, "limit": 60.0,
                             "ticket": None, "ticket_mac": ""})
        (out / f"pushed{rank}").write_text(json.dumps(pushed))
        _wait_for(out / "stepped")
        pulled = worker.run({"op": "pull", "version": 1, "limit": 60.0})
        whole = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        # A version the followers do not have: every rank stops at its first layer, and
        # nothing of the model changes.
        gone = worker.run({"op": "pull", "version": 5, "limit": 30.0})
        unchanged = all(torch.equal(p.full_tensor(), whole[n])
                        for n, p in model.named_parameters())
        # Rank 1 fails its third layer: both ranks stop after the first two steps' layers.
        stage, fetched = worker.stage, []

        def flaky(version, layer, follower, out):
            fetched.append(layer)
            if rank == 1 and len(fetched) == 3:
                raise TimeoutError("injected: no reply")
            return type(stage).pull_layer(stage, version, layer, follower, out)

        stage.pull_layer = flaky
        half = worker.run({"op": "pull", "version": 1, "limit": 30.0})
        del stage.pull_layer
        mine = [p for _, ps in worker.mine.items() for _, p in ps]
        report = {"pulled": pulled, "gone": gone, "unchanged": unchanged, "half": half,
                  "allocated": allocated,
                  "slots": worker.slots.allocated_bytes, "in_use": worker.slots.in_use,
                  "largest": max(sum(p.numel() for _, p in ps) for ps in worker.mine.values()) * 2,
                  "block": sum(p.numel() for p in mine) * 2, "wire": len(worker.stage._wire)}
        if rank == 0:
            torch.save(whole, out / "whole.pt")
        (out / f"report{rank}.json").write_text(json.dumps(report))
        worker.close()
    finally:
        dist.destroy_process_group()


def test_fsdp2_ranks_stage_one_layer_at_a_time_and_push_what_one_process_pushes(tmp_path):
    from dips.algo import clip_factor, partition_contiguous, token_weights
    from dips.algo.refusal import Refusal
    from dips.roles.cluster import StageWorker
    from dips.roles.follower import FollowerShard
    from dips.roles.layers import group_layers, layer_table
    from dips.wire.dataplane import DataServer
    from dips.wire.keys import Keyring, issue
    from dips.wire.pki import Identity

    theta0 = {n: p.detach().clone() for n, p in _net(perturbed=False).named_parameters()}
    table = layer_table(_net(perturbed=False))
    assert len(table) == LAYERS
    shards, servers, owner = [], [], {}
    for i, r in enumerate(partition_contiguous([b for _, _, b in table], 2)):
        layers = {table[j][0]: table[j][1] for j in r}
        owner.update({l: i for l in layers})
        shards.append(FollowerShard(i, layers, theta0, log_dir=tmp_path / f"f{i}"))
        servers.append(DataServer(Keyring(SECRET), shards[-1].handle,
                                  authorize=shards[-1].authorize).start())
    endpoints = {str(i): s.endpoint for i, s in enumerate(servers)}
    key = issue(SECRET, Identity.cluster("fsdp"), False)
    setup = {"owner": owner, "endpoints": endpoints, "key_id": key.key_id, "key": key.key.hex()}
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path), setup)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for r in range(2):
            _wait_for(tmp_path / f"pushed{r}", 150)
        pushed = json.loads((tmp_path / "pushed0").read_text())
        assert [r["error"] for r in pushed] == [None, None], pushed

        # One process holding the same full model pushes it as cluster "one".
        one = _net(perturbed=True)
        worker = StageWorker(0, dict(group_layers(one)), issue(SECRET, Identity.cluster("one"),
                             False), {int(f): ep for f, ep in endpoints.items()}, 30.0)
        worker.push("one", 1, "6f6e6500" + "00000001", [(l, owner[l]) for l, _, _ in table], 100)
        worker.close()
        clusters = ["fsdp", "one"]
        for s in shards:
            assert [v[1] for v in s.score(1, clusters)] == [True, True]
            a, b = s._staged[(1, "fsdp")], s._staged[(1, "one")]
            for n in s.names:  # Δ formed at receipt from each push: the same bits
                assert torch.equal(a.delta[n], b.delta[n]), n
        w = token_weights({"fsdp": 100, "one": 100}, clusters)
        total = sum(s.aggregate(1, clusters, [w[c] for c in clusters]) for s in shards)
        for s in shards:
            s.apply(1, clip_factor(total, 1.0), 1, clusters, [w[c] for c in clusters])
            s.commit(1)
        (tmp_path / "stepped").write_text("1")

        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        whole = torch.load(tmp_path / "whole.pt")
        theta1 = {n: t for s in shards for n, t in s.params.items()}
        assert whole.keys() == theta1.keys()
        for n, t in whole.items():  # the BF16 image of θ1, widened into the shards
            assert torch.equal(t, theta1[n].to(torch.bfloat16).float()), n
        for r in range(2):
            rep = json.loads((tmp_path / f"report{r}.json").read_text())
            assert [x["error"] for x in rep["pulled"]] == [None, None]
            assert [x["loaded"] for x in rep["pulled"]] == [LAYERS, LAYERS]
            assert all(x["refusals"] == [int(Refusal.VERSION_GONE)] for x in rep["gone"]), rep
            assert [x["loaded"] for x in rep["gone"]] == [0, 0] and rep["unchanged"]
            assert [x["loaded"] for x in rep["half"]] == [4, 4]
            assert rep["half"][0]["error"] is None and "injected" in rep["half"][1]["error"]
            assert rep["wire"] == 0  # no per-parameter buffers of the whole block
            assert sum(rep["allocated"]) == rep["slots"] > 0 and rep["in_use"] == 0
            bound = (StageWorker.depth + 1) * rep["largest"]
            assert sum(rep["allocated"]) <= bound < rep["block"], rep
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        for s in servers:
            s.stop()
