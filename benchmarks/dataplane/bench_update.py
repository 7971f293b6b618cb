"""Benchmark 2 of issue 5: the follower's outer update against fused SGD(nesterov) (§6, §8).

One FollowerShard holding ``layers`` × Linear(width, width) (FP32 θ and momentum). Each round
the clusters' pushes are streamed into it exactly as the data plane delivers them (Δ, ‖Δ‖²
and, when the pushes carry token counts, the round's token-weighted sum formed at receipt;
timed separately); then the leader's update calls are timed, in order: ``score`` (per-cluster
‖Δ‖²), ``aggregate`` (token-weighted mean δ and ‖δ‖²), ``apply`` (clip + Nesterov in FP32,
and the XXH3 checksum of θ') and ``commit`` (swap in θ', start the background copy of the new
version into the spare buffers). Three cases: two clusters (T = 300 and 100), one cluster, and
two clusters whose pushes carry no token count (δ formed when the leader asks, as before).

Reference, same shard size, same run: ``torch.optim.SGD(lr=0.7, momentum=0.8,
nesterov=True, fused=True)`` on tensors of the same sizes, stepped right before every measured
update (once the background copy of the previous commit is done) so both see the same load. Also shown: the algo functions alone on preallocated
tensors (:func:`dips.algo.weighted_mean`, :func:`dips.algo.clip_factor`,
:func:`dips.algo.nesterov_step`), and the work moved off the update path (receipt of a push,
the background copy after commit).

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


def _stage(shard, rnd: int, cluster: str, params: dict, seed: int, tokens: int) -> float:
    """Stream one push into the shard as the data plane does; returns the seconds spent in the
    follower (forming Δ, ‖Δ‖² and the round's sum), not in making the test data."""
    import torch

    from dips.wire.frames import tensor_bytes
    from dips.wire.stream import TensorSpec

    g = torch.Generator().manual_seed(seed)
    spent = 0.0
    for layer, names in shard.layers.items():
        local = [(n, (params[n] + 1e-3 * torch.randn(params[n].shape, generator=g)).to(torch.bfloat16))
                 for n in names]
        t0 = time.perf_counter()
        sink = shard.open_push({"op": "push", "cluster": cluster, "round": rnd, "layer": layer,
                                "tokens": tokens}, [TensorSpec.of(n, t) for n, t in local])
        for i, (_, t) in enumerate(local):
            raw = tensor_bytes(t)
            for off in range(0, len(raw), 2 << 20):
                sink.write(i, off, raw[off:off + (2 << 20)])
        sink.commit()
        spent += time.perf_counter() - t0
    return spent


def _rounds(shard, params: dict, tokens: dict[str, int], rounds: int, first: int,
            sgd_step) -> dict:
    """``rounds`` outer steps (after one unmeasured warm-up) of the clusters in ``tokens``;
    median seconds of each update call, of the receipt work per push, of the background
    refresh of the spare state, and of ``sgd_step()`` (the reference) timed right before each
    update, so that both see the same machine load."""
    from dips.algo import clip_factor, token_weights

    clusters = list(tokens)
    w = token_weights({c: t or 100 for c, t in tokens.items()}, clusters)
    weights = [w[c] for c in clusters]
    steps: dict[str, list[float]] = {k: [] for k in
                                     ("score", "aggregate", "apply", "commit", "total",
                                      "receipt_first", "receipt_later", "spare_refresh", "sgd")}
    for r in range(-1, rounds):  # round -1: first touch of every buffer, unmeasured
        rnd = first + r + 1
        receipt = [_stage(shard, rnd, c, shard.params, 10 * rnd + j, tokens[c])
                   for j, c in enumerate(clusters)]
        shard._spare.wait()  # the background copy after the previous commit (off the update path)
        refreshed = shard._spare.background_s
        t_sgd = sgd_step()  # the reference, under the same load as the update that follows
        t = [time.perf_counter()]
        shard.score(rnd, clusters)
        t.append(time.perf_counter())
        sq = shard.aggregate(rnd, clusters, weights)
        t.append(time.perf_counter())
        shard.apply(rnd, clip_factor(sq, 1.0), shard.version + 1, clusters, weights)
        t.append(time.perf_counter())
        shard.commit(shard.version + 1)
        t.append(time.perf_counter())
        if r >= 0:
            for k, (a, b) in zip(("score", "aggregate", "apply", "commit"), zip(t, t[1:])):
                steps[k].append(b - a)
            steps["total"].append(t[-1] - t[0])
            steps["receipt_first"].append(receipt[0])
            steps["receipt_later"].append(statistics.mean(receipt[1:]) if receipt[1:] else 0.0)
            steps["spare_refresh"].append(refreshed)
            steps["sgd"].append(t_sgd)
    return {k: statistics.median(v) for k, v in steps.items()}


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

    # Reference: fused SGD(nesterov) on tensors of the same sizes, stepped after every update.
    ref = [p.clone().requires_grad_(True) for p in params.values()]
    deltas = [torch.randn(p.shape) * 1e-3 for p in params.values()]
    opt = torch.optim.SGD(ref, lr=0.7, momentum=0.8, nesterov=True, fused=True)
    for p, d in zip(ref, deltas):
        p.grad = d
    opt.step()  # creates the momentum buffers

    def sgd_step() -> float:
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0

    shard = FollowerShard(0, layers, params)
    cases = {"2 clusters": {"a": 300, "b": 100}, "1 cluster": {"a": 300},
             "2 clusters, no sum": {"a": None, "b": None}}
    res, first = {}, 0
    for name, tokens in cases.items():
        res[name] = _rounds(shard, params, tokens, args.rounds, first, sgd_step)
        first += args.rounds + 2
    med = res["2 clusters"]
    t_sgd = statistics.median(m["sgd"] for m in res.values())
    w = token_weights({"a": 300, "b": 100}, ["a", "b"])

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

    out = {"params": numel, "state_bytes": state, "follower_s": res, "sgd_fused_s": t_sgd,
           "algo_only_s": t_algo,
           "follower_gbps": state / med["total"] / 1e9, "sgd_gbps": state / t_sgd / 1e9,
           "ratio_follower_vs_sgd": med["sgd"] / med["total"],
           "ratio_one_cluster_vs_sgd": res["1 cluster"]["sgd"] / res["1 cluster"]["total"],
           "ratio_no_sum_vs_sgd": res["2 clusters, no sum"]["sgd"] / res["2 clusters, no sum"]["total"],
           "ratio_algo_vs_sgd": t_sgd / t_algo}
    print("\n2. follower outer update (median s)        score  aggregate  apply  commit   total")
    for name, m in res.items():
        print(f"   FollowerShard, {name:19s} {m['score']:7.3f} {m['aggregate']:9.3f} "
              f"{m['apply']:7.3f} {m['commit']:7.3f} {m['total']:7.3f}"
              f"  -> {state / m['total'] / 1e9:.2f} GB/s of state; fused SGD beside it "
              f"{m['sgd']:.3f}: {m['sgd'] / m['total']:.0%}")
    print(f"   fused SGD(nesterov)                                                 {t_sgd:7.3f}"
          f"  -> {out['sgd_gbps']:.2f} GB/s of state")
    print(f"   algo alone (mean+clip+nesterov, preallocated)                       {t_algo:7.3f}"
          f"  -> {state / t_algo / 1e9:.2f} GB/s of state")
    print(f"   follower (2 clusters) / fused SGD: {out['ratio_follower_vs_sgd']:.0%} (target >= 50%); "
          f"algo alone / fused SGD: {out['ratio_algo_vs_sgd']:.0%}")
    print("   off the update path (median s): receipt of a push (Δ, ‖Δ‖²) "
          f"{med['receipt_first']:.3f}, of a second push (+ the round's sum) "
          f"{med['receipt_later']:.3f} (no sum: {res['2 clusters, no sum']['receipt_later']:.3f}); "
          f"background copy of θ + momentum after commit {med['spare_refresh']:.3f}")
    print("RESULT " + json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
