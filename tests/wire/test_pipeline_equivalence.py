"""The pipelined data plane and the naive one leave the followers bit-identical (§6, §10).

Two identical parameter servers (2 followers each, real DataServers on loopback) receive the
same pushes from 2 clusters of 2 stage workers, once through chunked streams (Δ and the
round's token-weighted sum formed at receipt into pooled buffers) and once through one message
per layer (Δ and the sum formed when scored);
after two outer steps θ, the momenta and what a cluster pulls must be equal bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from dips.algo import clip_factor, greedy_schedule, partition_contiguous, token_weights
from dips.roles.cluster import StageWorker
from dips.roles.follower import FollowerShard
from dips.wire.dataplane import DataPlaneError, DataServer
from dips.wire.keys import Keyring, MemberKey, issue
from dips.wire.pki import Identity

pytestmark = pytest.mark.timeout(120)
SECRET = b"e" * 32  # the data secret the followers hold; each member's key derives from it


def _key(cluster: str) -> MemberKey:
    return issue(SECRET, Identity.cluster(cluster), False)

SHAPES = {"emb": [("emb.w", (1030, 1024))],  # > 1M elements: 2 norm blocks
          **{f"l{i}": [(f"l{i}.a", (24, 40)), (f"l{i}.b", (40,))] for i in range(4)},
          "head": [("head.w", (24, 50)), ("head.n", (24,))]}
LAYERS = list(SHAPES)


def _params(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * scale for l in LAYERS for n, s in SHAPES[l]}


def _perturbed(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    noise = _params(seed, 1e-2)
    return {n: (t + noise[n]).requires_grad_(False) for n, t in base.items()}


class PS:
    def __init__(self, mode: str, tmp_path, state_dtype: str = "fp32", dtype: str = "bf16"):
        self.mode, self.dtype = mode, dtype
        theta0 = _params(0)
        sizes = [sum(theta0[n].numel() * 4 for n, _ in SHAPES[l]) for l in LAYERS]
        self.owner: dict[str, int] = {}
        self.shards, self.servers = [], []
        for i, r in enumerate(partition_contiguous(sizes, 2)):
            layers = {LAYERS[j]: [n for n, _ in SHAPES[LAYERS[j]]] for j in r}
            self.owner.update({l: i for l in layers})
            shard = FollowerShard(i, layers, theta0, log_dir=tmp_path / mode / f"f{i}",
                                  state_dtype=state_dtype)
            self.shards.append(shard)
            self.servers.append(DataServer(Keyring(SECRET), shard.handle,
                                            authorize=shard.authorize).start())
        self.endpoints = {i: s.endpoint for i, s in enumerate(self.servers)}

    def workers(self, params: dict[str, torch.Tensor], cluster: str) -> list[StageWorker]:
        out, key = [], _key(cluster)  # a cluster's stage workers share its key
        for k, layers in enumerate((LAYERS[:3], LAYERS[3:])):
            w = StageWorker(k, {l: [(n, params[n]) for n, _ in SHAPES[l]] for l in layers}, key,
                            self.endpoints, timeout_s=20, dtype=self.dtype)
            w.mode, w.chunk_bytes = self.mode, 1024  # many chunks per tensor
            out.append(w)
        return out

    def push(self, cluster: str, rnd: int, params: dict[str, torch.Tensor],
             tokens: int | None = None) -> None:
        index = {l: i for i, l in enumerate(LAYERS)}
        workers = self.workers(params, cluster)
        steps = greedy_schedule([[index[l] for l in w.layers] for w in workers],
                                {index[l]: f for l, f in self.owner.items()}, 2)
        for step in steps:
            for t in step:
                workers[t.worker].push(cluster, rnd, f"{ord(cluster[0]):08x}{rnd:08x}",
                                       [(LAYERS[t.layer], t.follower)], tokens)
        for w in workers:
            w.close()

    def outer_step(self, rnd: int, tokens: dict[str, int]) -> dict[str, float]:
        clusters = sorted(tokens)
        norms = {c: 0.0 for c in clusters}
        for s in self.shards:
            for c, valid, sq, err in s.score(rnd, clusters):
                assert valid, err
                norms[c] += sq
        w = token_weights(tokens, clusters)
        total = sum(s.aggregate(rnd, clusters, [w[c] for c in clusters]) for s in self.shards)
        clip = clip_factor(total, 1.0)
        for s in self.shards:
            s.apply(rnd, clip, s.version + 1, clusters, [w[c] for c in clusters])
            if hasattr(s, "commit"):
                s.commit(s.version + 1)
        return norms

    def pull(self, version: int) -> dict[str, torch.Tensor]:
        workers = self.workers(_params(9), "a")
        out = {}
        for w in workers:
            out.update({n: t.clone() for n, t in w.pull(version, self.owner).items()})
            w.close()
        return out

    def close(self):
        for s in self.servers:
            s.stop()


def test_streamed_and_single_message_paths_are_bit_identical(tmp_path):
    runs = {m: PS(m, tmp_path) for m in ("stream", "single")}
    try:
        base = _params(0)
        tokens = {"a": 300, "b": 100}
        for rnd in (1, 2):
            norms = {}
            for m, ps in runs.items():
                for j, c in enumerate(("a", "b")):
                    # round 1: the round's sum formed at receipt; round 2: δ formed when asked
                    ps.push(c, rnd, _perturbed(base, 10 * rnd + j), tokens[c] if rnd == 1 else None)
                norms[m] = ps.outer_step(rnd, tokens)
            assert norms["stream"] == norms["single"]  # ‖Δ‖² formed at receipt, bit for bit
        pulled = {m: ps.pull(2) for m, ps in runs.items()}
        for fa, fb in zip(runs["stream"].shards, runs["single"].shards):
            assert fa.version == fb.version == 2
            for n in fa.names:
                assert torch.equal(fa.params[n], fb.params[n]), n
                assert torch.equal(fa.momenta[n], fb.momenta[n]), n
        assert pulled["stream"].keys() == pulled["single"].keys()
        for n, t in pulled["stream"].items():
            assert t.dtype == torch.bfloat16 and torch.equal(t, pulled["single"][n]), n
        # The streamed path formed Δ in pooled buffers, reused by the second round.
        pool = runs["stream"].shards[0]._stream_pools()[0]
        assert pool.allocated == 2 and pool.reused == 2
        # Both paths formed round 1's sum (only round 1's pushes carried token counts).
        assert all(s._sum_pool.allocated == 1 for ps in runs.values() for s in ps.shards)
    finally:
        for ps in runs.values():
            ps.close()


def test_refused_stream_marks_the_push_invalid_and_changes_nothing(tmp_path):
    ps = PS("stream", tmp_path)
    try:
        before = [s.state()[2] for s in ps.shards]
        bad = _perturbed(_params(0), 1)
        bad["l1.a"][3, 4] = float("nan")
        with pytest.raises(DataPlaneError, match="'l1.a' contains NaN"):
            ps.push("x", 1, bad)
        verdict = ps.shards[ps.owner["l1"]].score(1, ["x"])[0]
        assert verdict[1] is False and "'l1.a' contains NaN" in verdict[3]
        assert [s.state()[2] for s in ps.shards] == before
    finally:
        ps.close()


def test_control_calls_never_wait_behind_a_transfer(tmp_path):
    """While a push stream and a pull stream are half-way through, the shard's lock (taken by
    score/aggregate/apply and by checkpoints) is free: bulk data never holds it."""
    import threading

    from dips.wire.dataclient import DataClient

    ps = PS("stream", tmp_path)
    try:
        shard = ps.shards[0]
        layer = next(iter(shard.layers))
        gate, sent = threading.Event(), []

        def limiter(n: int) -> None:  # stalls the stream after its first chunks
            sent.append(n)
            if len(sent) == 4:
                assert gate.wait(30)

        client = DataClient(_key("a"), ps.endpoints[0], timeout_s=30, limiter=limiter)
        local = [(n, shard.params[n].to(torch.bfloat16)) for n in shard.layers[layer]]
        t = threading.Thread(target=lambda: sent.append(client.push(
            {"op": "push", "cluster": "a", "round": 1, "layer": layer}, local, chunk_bytes=1024)))
        t.start()
        while len(sent) < 4:
            threading.Event().wait(0.01)
        assert shard._lock.acquire(timeout=10)  # held by nobody mid-stream
        shard._lock.release()
        assert shard.score(1, ["a"])[0][1] is False  # incomplete push: invalid, not blocked
        gate.set()
        t.join(30)
        assert sent[-1]["op"] == "ack"
        assert shard.score(1, ["a"])[0][1] is (len(shard.layers) == 1)  # complete iff sole layer
        client.close()
    finally:
        ps.close()


def test_fp32_wire_carries_exact_values_both_ways(tmp_path):
    """``outer.wire_dtype: fp32``: the followers form Δ from the exact FP32 push, and a pull
    returns θ bit for bit (BF16, the default, rounds both)."""
    from dips.algo import squared_norm

    runs = {d: PS("stream", tmp_path / d, dtype=d) for d in ("fp32", "bf16")}
    try:
        base, local = _params(0), _perturbed(_params(0), 7)
        exact = squared_norm([base[n] - local[n] for n in base])
        norms = {}
        for d, ps in runs.items():
            ps.push("a", 1, local, 100)
            norms[d] = sum(ps.outer_step(1, {"a": 100}).values())
        assert norms["fp32"] == pytest.approx(exact, rel=1e-6)
        assert abs(norms["bf16"] - exact) > 1e-3 * exact  # the BF16 push rounds local
        pulled = runs["fp32"].pull(1)
        for s in runs["fp32"].shards:
            for n in s.names:
                assert pulled[n].dtype == torch.float32 and torch.equal(pulled[n], s.params[n]), n
    finally:
        for ps in runs.values():
            ps.close()


def test_bf16_state_holds_only_bf16_values(tmp_path):
    """``outer.state_dtype: bf16`` (§15's BF16 + BF16 ablation): after an outer step every θ
    and momentum element is a BF16 value; with FP32 state they are not."""
    runs = {d: PS("stream", tmp_path / d, state_dtype=d) for d in ("bf16", "fp32")}
    try:
        for ps in runs.values():
            ps.push("a", 1, _perturbed(_params(0), 3), 100)
            ps.outer_step(1, {"a": 100})

        def bf16_valued(t: torch.Tensor) -> bool:
            return torch.equal(t, t.to(torch.bfloat16).float())

        for d, ps in runs.items():
            held = [bf16_valued(t) for s in ps.shards for m in (s.params, s.momenta)
                    for t in m.values()]
            assert all(held) if d == "bf16" else not any(held), d
    finally:
        for ps in runs.values():
            ps.close()
