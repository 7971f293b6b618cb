"""Benchmarks 1 and 3 of issue 5: push + pull through the real leader and followers, and the
outer loop broken into push / update / pull, pipelined against naive (§10, §15 of the seed).

Setup: the real leader (gRPC, in this process), M follower processes (FollowerShard, ZeroMQ
DataServer, gRPC control), one cluster (:class:`dips.roles.client.ClusterClient` with S stage
workers) holding a ``layers`` × Linear(width, width) model. Each round perturbs the model
(standing in for H inner steps) and calls ``sync()``: push (BF16), the leader's update (score,
penalty, aggregate, clip, Nesterov; penalty off so every round applies), pull (BF16).

1. Throughput of push + pull = 2 × (BF16 bytes of the model) / (push_s + pull_s), against raw
   TCP loopback between two processes moving the same number of bytes, measured in this run.
2. push_s / wait_s (the update, seen by the cluster) / pull_s with ``StageWorker.mode =
   "stream"`` (chunked, pooled, pipelined) against ``"single"`` (one message per layer, fresh
   buffers, Δ formed at scoring, pull converted per request); rounds alternate the modes.

Usage: python benchmarks/dataplane/bench_transfer.py [--layers 12 --width 2048 --rounds 3]
Prints a table and one JSON line (``RESULT {...}``).
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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--followers", type=int, default=2)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    import torch

    from dips.roles.cluster import StageWorker

    torch.set_num_threads(1)
    model = harness.synthetic_model(args.layers, args.width, seed=0)
    nbytes = harness.wire_bytes(model)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"{nbytes * 2 / 1e6:.0f} MB FP32, {nbytes / 1e6:.0f} MB BF16 per push or pull; "
          f"{args.followers} follower processes, {args.stages} stage workers", flush=True)
    raw = [harness.raw_tcp_bytes_per_s(2 * nbytes)]
    ps = harness.PS(("synthetic", args.layers, args.width, 0), args.followers)
    times: dict[str, list[tuple[float, float, float]]] = {"stream": [], "single": []}
    try:
        client = ps.client("c0", args.stages, model)
        for r in range(-1, args.rounds):  # round -1 warms both paths up (first touch), unmeasured
            for mode in (("stream", "single") if r % 2 == 0 else ("single", "stream")):
                StageWorker.mode = mode
                harness.perturb(model, seed=100 + r)
                res = client.sync()
                if not (res.ok and res.accepted):
                    raise RuntimeError(f"round {r} ({mode}) failed: {res.reason}")
                if r >= 0:
                    times[mode].append((res.push_s, res.wait_s, res.pull_s))
                print(f"  round {r} {mode:6s}: push {res.push_s:.3f} s, update (wait) "
                      f"{res.wait_s:.3f} s, pull {res.pull_s:.3f} s", flush=True)
        client.close()
    finally:
        StageWorker.mode = "stream"
        ps.close()
    raw.append(harness.raw_tcp_bytes_per_s(2 * nbytes))
    raw_bps = max(raw)

    med = {m: [statistics.median(x[i] for x in t) for i in range(3)] for m, t in times.items()}
    rate = {m: 2 * nbytes / (med[m][0] + med[m][2]) for m in med}
    total = {m: sum(med[m]) for m in med}
    out = {
        "model_fp32_bytes": 2 * nbytes, "wire_bytes_per_direction": nbytes,
        "raw_tcp_gbps": raw_bps / 1e9, "raw_tcp_runs_gbps": [x / 1e9 for x in raw],
        "push_pull_gbps": {m: rate[m] / 1e9 for m in rate},
        "ratio_vs_raw_tcp": {m: rate[m] / raw_bps for m in rate},
        "median_s": {m: dict(zip(("push", "update", "pull"), med[m])) for m in med},
        "outer_loop_s": total, "speedup_stream_vs_single": total["single"] / total["stream"],
    }
    print("\n1. push + pull through leader and followers vs raw TCP loopback (same bytes, same run)")
    print(f"   raw TCP {raw_bps / 1e9:.2f} GB/s (runs: {', '.join(f'{x / 1e9:.2f}' for x in raw)})")
    for m in ("stream", "single"):
        print(f"   {m:6s}: {rate[m] / 1e9:.2f} GB/s = {rate[m] / raw_bps:.0%} of raw TCP "
              f"(target >= 60% for stream)")
    print("\n3. outer loop (median s)      push    update    pull    total")
    for m in ("single", "stream"):
        p, u, q = med[m]
        print(f"   {m:22s} {p:8.3f} {u:9.3f} {q:7.3f} {total[m]:8.3f}")
    print(f"   speedup stream vs single: {out['speedup_stream_vs_single']:.2f}x "
          f"(paper 1.21x, target >= 1.5x)")
    print("RESULT " + json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    t0 = time.monotonic()
    main()
    print(f"({time.monotonic() - t0:.0f} s)")
