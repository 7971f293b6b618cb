"""Benchmarks 1 and 3 of issue 5: push + pull through the real leader and followers, and the
outer loop broken into push / update / pull, pipelined against naive (§10, §15 of the seed).

Setup: the real leader (gRPC, in this process), M follower processes (FollowerShard, ZeroMQ
DataServer, gRPC control), one cluster (:class:`dips.roles.client.ClusterClient` with S stage
workers) holding a ``layers`` × Linear(width, width) model. Each round perturbs the model
(standing in for H inner steps) and calls ``sync()``: push (BF16), the leader's update (score,
penalty, aggregate, clip, Nesterov; penalty off so every round applies), pull (BF16).

1. Throughput of push + pull = 2 × (BF16 bytes of the model) / (push_s + pull_s), against raw
   TCP loopback between two processes moving the same number of bytes, and against the
   transport ceiling: ZeroMQ alone moving the same bytes between two processes with the data
   plane's framing (DEALER → ROUTER push, ROUTER → DEALER pull, ``[C, meta, tag, data]``
   multipart, ``copy=False``, the same chunk size; no conversion, no authentication, no Δ),
   both measured in this run (best of 5 transfers, before and after the rounds).
   Measured twice in the same run: ``--insecure`` (plaintext gRPC, chunks authenticated with
   Poly1305) and secure (as ``dips launch`` runs: mutual TLS, per-member keys, every chunk
   encrypted with AES-256-GCM), streamed; the secure rate is also given as a share of the
   insecure one (issue 11: target >= 90%).
2. push_s / wait_s (the update, seen by the cluster) / pull_s with ``StageWorker.mode =
   "stream"`` (chunked, pooled, pipelined) against ``"single"`` (one message per layer, fresh
   buffers, Δ formed at scoring, pull converted per request); rounds alternate the modes.

Usage: python benchmarks/dataplane/bench_transfer.py [--layers 12 --width 2048 --rounds 3]
       [--chunk-mib 4]
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
    ap.add_argument("--chunk-mib", type=float, default=None,
                    help="stream chunk size in MiB (default: StageWorker.chunk_bytes)")
    args = ap.parse_args(argv)

    import torch

    from dips.roles.cluster import StageWorker

    if args.chunk_mib:
        StageWorker.chunk_bytes = int(args.chunk_mib * (1 << 20)) // 4 * 4
    chunk = StageWorker.chunk_bytes

    torch.set_num_threads(1)
    model = harness.synthetic_model(args.layers, args.width, seed=0)
    nbytes = harness.wire_bytes(model)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"{nbytes * 2 / 1e6:.0f} MB FP32, {nbytes / 1e6:.0f} MB BF16 per push or pull; "
          f"{args.followers} follower processes, {args.stages} stage workers, "
          f"chunks of {chunk / (1 << 20):g} MiB", flush=True)
    raw = [harness.raw_tcp_bytes_per_s(2 * nbytes, reps=5)]
    zmq_runs = [harness.zmq_bytes_per_s(nbytes, chunk, reps=5)]
    times: dict[str, list[tuple[float, float, float]]] = {"stream": [], "single": [], "secure": []}
    secure_model = harness.synthetic_model(args.layers, args.width, seed=0)
    ps = harness.PS(("synthetic", args.layers, args.width, 0), args.followers)
    sps = harness.PS(("synthetic", args.layers, args.width, 0), args.followers, secure=True)
    try:
        clients = {"plain": ps.client("c0", args.stages, model),
                   "secure": sps.client("c1", args.stages, secure_model)}
        order = ["secure", "stream", "single"]
        for r in range(-1, args.rounds):  # round -1 warms every path up (first touch), unmeasured
            for mode in order[r % 3:] + order[:r % 3]:  # rotated: no mode always first
                StageWorker.mode = "single" if mode == "single" else "stream"
                m, client = ((secure_model, clients["secure"]) if mode == "secure"
                             else (model, clients["plain"]))
                harness.perturb(m, seed=100 + r)
                res = client.sync()
                if not (res.ok and res.accepted):
                    raise RuntimeError(f"round {r} ({mode}) failed: {res.reason}")
                if r >= 0:
                    times[mode].append((res.push_s, res.wait_s, res.pull_s))
                print(f"  round {r} {mode:6s}: push {res.push_s:.3f} s, update (wait) "
                      f"{res.wait_s:.3f} s, pull {res.pull_s:.3f} s", flush=True)
        for c in clients.values():
            c.close()
    finally:
        StageWorker.mode = "stream"
        ps.close()
        sps.close()
    raw.append(harness.raw_tcp_bytes_per_s(2 * nbytes, reps=5))
    zmq_runs.append(harness.zmq_bytes_per_s(nbytes, chunk, reps=5))
    raw_bps = max(raw)
    zmq_push, zmq_pull = max(z[0] for z in zmq_runs), max(z[1] for z in zmq_runs)
    zmq_bps = 2 * nbytes / (nbytes / zmq_push + nbytes / zmq_pull)

    med = {m: [statistics.median(x[i] for x in t) for i in range(3)] for m, t in times.items()}
    rate = {m: 2 * nbytes / (med[m][0] + med[m][2]) for m in med}
    total = {m: sum(med[m]) for m in med if m != "secure"}
    out = {
        "model_fp32_bytes": 2 * nbytes, "wire_bytes_per_direction": nbytes,
        "raw_tcp_gbps": raw_bps / 1e9, "raw_tcp_runs_gbps": [x / 1e9 for x in raw],
        "zmq_gbps": zmq_bps / 1e9, "zmq_push_gbps": zmq_push / 1e9, "zmq_pull_gbps": zmq_pull / 1e9,
        "zmq_runs_gbps": [[x / 1e9 for x in z] for z in zmq_runs], "chunk_bytes": chunk,
        "push_pull_gbps": {m: rate[m] / 1e9 for m in rate},
        "push_gbps": {m: nbytes / med[m][0] / 1e9 for m in med},
        "pull_gbps": {m: nbytes / med[m][2] / 1e9 for m in med},
        "ratio_vs_raw_tcp": {m: rate[m] / raw_bps for m in rate},
        "ratio_vs_zmq": {m: rate[m] / zmq_bps for m in rate},
        "zmq_vs_raw_tcp": zmq_bps / raw_bps,
        "median_s": {m: dict(zip(("push", "update", "pull"), med[m])) for m in med},
        "outer_loop_s": total, "speedup_stream_vs_single": total["single"] / total["stream"],
        "secure_vs_insecure": rate["secure"] / rate["stream"],
    }
    print("\n1. push + pull through leader and followers vs raw TCP loopback and vs ZeroMQ alone "
          "(same bytes, same run)")
    print(f"   raw TCP {raw_bps / 1e9:.2f} GB/s (runs: {', '.join(f'{x / 1e9:.2f}' for x in raw)})")
    print(f"   ZeroMQ alone, data-plane framing: {zmq_bps / 1e9:.2f} GB/s = {zmq_bps / raw_bps:.0%} "
          f"of raw TCP (push {zmq_push / 1e9:.2f}, pull {zmq_pull / 1e9:.2f} GB/s; runs: "
          f"{', '.join(f'{a / 1e9:.2f}/{b / 1e9:.2f}' for a, b in zmq_runs)})")
    for m in ("secure", "stream", "single"):
        print(f"   {m:6s}: {rate[m] / 1e9:.2f} GB/s (push {out['push_gbps'][m]:.2f}, pull "
              f"{out['pull_gbps'][m]:.2f}) = {rate[m] / raw_bps:.0%} of raw TCP, "
              f"{rate[m] / zmq_bps:.0%} of ZeroMQ alone")
    print(f"   secure (TLS + AES-GCM chunks) / insecure stream: {out['secure_vs_insecure']:.0%} "
          f"(target >= 90%); secure / raw TCP: {rate['secure'] / raw_bps:.0%} (target >= 35%)")
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
