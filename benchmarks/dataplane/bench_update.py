"""Benchmark 2 of issue 5: the follower's outer update against fused SGD(nesterov) (§6, §8).

One FollowerShard holding ``layers`` × Linear(width, width) (FP32 θ and momentum). Each round
two clusters' pushes are streamed into it exactly as the data plane delivers them (Δ formed
and ‖Δ‖² accumulated at receipt, untimed); then the leader's update calls are timed, in
order: ``score`` (per-cluster ‖Δ‖²), ``aggregate`` (token-weighted mean δ and ‖δ‖²),
``apply`` (clip + Nesterov, FP32) and ``commit`` (if the shard has the two-phase API).

Reference, same shard size, same run: ``torch.optim.SGD(lr=0.7, momentum=0.8,
nesterov=True, fused=True)`` with ``p.grad = δ`` (after one warm-up step, so its momentum
buffers exist). Also shown: the algo functions alone on preallocated tensors
(:func:`dips.algo.weighted_mean`, :func:`dips.algo.clip_factor`, :func:`dips.algo.nesterov_step`).

Throughput = bytes of optimizer state (θ + momentum, 8 bytes per parameter) / seconds.
Usage: python benchmarks/dataplane/bench_update.py [--layers 12 --width 2048 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402


def _stage(shard, rnd: int, cluster: str, params: dict, seed: int) -> None:
    import torch

    from dips.wire.frames import tensor_bytes
    from dips.wire.stream import TensorSpec

    g = torch.Generator().manual_seed(seed)
    for layer, names in shard.layers.items():
        local = [(n, (params[n] + 1e-3 * torch.randn(params[n].shape, generator=g)).to(torch.bfloat16))
                 for n in names]
        sink = shard.open_push({"op": "push", "cluster": cluster, "round": rnd, "layer": layer},
                               [TensorSpec.of(n, t) for n, t in local])
        for i, (_, t) in enumerate(local):
            raw = tensor_bytes(t)
            for off in range(0, len(raw), 2 << 20):
                sink.write(i, off, raw[off:off + (2 << 20)])
        sink.commit()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    import torch

    from dips.algo import clip_factor, nesterov_step, token_weights, weighted_mean
    from dips.roles.follower import FollowerShard

    torch.set_num_threads(1)
    shapes = harness.param_shapes(args.layers, args.width)
    params = {n: harness.init_param(0, k, s) for k, (n, s) in enumerate(shapes)}
    layers = {l: [n for n, _ in shapes if harness.layer_of(n) == l] for l in dict.fromkeys(
        harness.layer_of(n) for n, _ in shapes)}
    numel = sum(p.numel() for p in params.values())
    state = 8 * numel
    print(f"shard: {numel / 1e6:.1f}M params, state (θ + momentum) {state / 1e6:.0f} MB", flush=True)

    shard = FollowerShard(0, layers, params)
    steps: dict[str, list[float]] = {k: [] for k in ("score", "aggregate", "apply", "commit", "total")}
    w = token_weights({"a": 300, "b": 100}, ["a", "b"])
    for r in range(-1, args.rounds):  # round -1: first touch of every buffer, unmeasured
        rnd = r + 2
        _stage(shard, rnd, "a", shard.params, 10 * rnd)
        _stage(shard, rnd, "b", shard.params, 10 * rnd + 1)
        t = [time.perf_counter()]
        shard.score(rnd, ["a", "b"])
        t.append(time.perf_counter())
        sq = shard.aggregate(rnd, ["a", "b"], [w["a"], w["b"]])
        t.append(time.perf_counter())
        shard.apply(rnd, clip_factor(sq, 1.0), shard.version + 1, ["a", "b"], [w["a"], w["b"]])
        t.append(time.perf_counter())
        if hasattr(shard, "commit"):
            shard.commit(shard.version + 1)
        t.append(time.perf_counter())
        if r >= 0:
            for k, (a, b) in zip(("score", "aggregate", "apply", "commit"), zip(t, t[1:])):
                steps[k].append(b - a)
            steps["total"].append(t[-1] - t[0])
    med = {k: statistics.median(v) for k, v in steps.items()}

    # Reference: fused SGD(nesterov) on the same tensors.
    ref = [p.clone().requires_grad_(True) for p in params.values()]
    deltas = [torch.randn(p.shape) * 1e-3 for p in params.values()]
    opt = torch.optim.SGD(ref, lr=0.7, momentum=0.8, nesterov=True, fused=True)
    sgd = []
    for r in range(args.rounds + 1):
        for p, d in zip(ref, deltas):
            p.grad = d
        t0 = time.perf_counter()
        opt.step()
        if r:
            sgd.append(time.perf_counter() - t0)
    t_sgd = statistics.median(sgd)

    # The algo functions alone on preallocated tensors (no follower bookkeeping).
    d2 = [torch.randn(p.shape) * 1e-3 for p in params.values()]
    mom = [torch.zeros_like(p) for p in params.values()]
    theta = [p.detach().clone() for p in ref]
    algo = []
    for r in range(args.rounds + 1):
        t0 = time.perf_counter()
        mean = weighted_mean([deltas, d2], [w["a"], w["b"]])
        clip = clip_factor(sum(float(torch.dot(m.reshape(-1), m.reshape(-1))) for m in mean), 1.0)
        nesterov_step(theta, mom, mean, 0.7, 0.8, scale=clip)
        if r:
            algo.append(time.perf_counter() - t0)
    t_algo = statistics.median(algo)

    out = {"params": numel, "state_bytes": state, "follower_s": med, "sgd_fused_s": t_sgd,
           "algo_only_s": t_algo,
           "follower_gbps": state / med["total"] / 1e9, "sgd_gbps": state / t_sgd / 1e9,
           "ratio_follower_vs_sgd": t_sgd / med["total"], "ratio_algo_vs_sgd": t_sgd / t_algo}
    print("\n2. follower outer update (median s)   score  aggregate  apply  commit   total")
    print(f"   FollowerShard                    {med['score']:7.3f} {med['aggregate']:9.3f} "
          f"{med['apply']:7.3f} {med['commit']:7.3f} {med['total']:7.3f}"
          f"  -> {out['follower_gbps']:.2f} GB/s of state")
    print(f"   fused SGD(nesterov)                                            {t_sgd:7.3f}"
          f"  -> {out['sgd_gbps']:.2f} GB/s of state")
    print(f"   algo alone (mean+clip+nesterov, preallocated)                  {t_algo:7.3f}"
          f"  -> {state / t_algo / 1e9:.2f} GB/s of state")
    print(f"   follower / fused SGD: {out['ratio_follower_vs_sgd']:.0%} (target >= 50%); "
          f"algo alone / fused SGD: {out['ratio_algo_vs_sgd']:.0%}")
    print("RESULT " + json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
