"""Benchmark 4 of issue 5: S = 4 stage workers × M = 4 followers, the §10 schedule against
plain layer order, in aggregate throughput.

Four follower processes (real FollowerShard + DataServer + gRPC control, the leader in this
process) own the layers of a ``layers`` × Linear(width, width) model round-robin (layer i ->
follower i mod 4, which spreads each pipeline stage's load over every follower); four stage
workers (threads, real :class:`dips.roles.cluster.StageWorker`) own contiguous blocks of 8
layers. One push moves every layer once.

* ``schedule``: each worker follows the leader's greedy schedule (:func:`dips.algo.greedy_schedule`,
  the same call the leader makes), with the per-follower link locks of StageWorker.
* ``plain``: each worker sends its layers in model order, uncoordinated: at the start all four
  send to follower 0, then all to follower 1, ...
* ``plain+locks``: plain order, but with the link locks (they alone stagger the workers).

Links: ``--rate-mb`` emulates each endpoint's network interface with the token-bucket
``limiter`` hook of DataClient (dips.wire.shaping.TokenBucket): every stage worker's upload and
every follower's download are limited to that many MB/s, so endpoint contention costs what it
costs on a real WAN. ``--rate-mb 0`` runs unshaped (loopback, CPU-bound on this machine).
Usage: python benchmarks/dataplane/bench_multilink.py [--rate-mb 100 --rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

S = M = 4


def _limiter(egress, ingress):
    def consume(n: int) -> None:
        wait = max(egress.reserve(n), ingress.reserve(n))  # both interfaces carry the bytes
        if wait > 0:
            time.sleep(wait)
    return consume


def _push_once(ps, model, plans, rnd: int, rate: float, shared_push_id: bool) -> float:
    from dips.roles.cluster import StageWorker
    from dips.wire.shaping import TokenBucket

    stage_layers = [[f"blocks.{i}" for i in range(s * 8, s * 8 + 8)] for s in range(S)]
    params = dict(model.named_parameters())
    key = ps.member_key("c0")  # the pushes are cluster c0's: its stage workers share its key
    workers = [StageWorker(s, {l: [(f"{l}.weight", params[f"{l}.weight"]),
                                   (f"{l}.bias", params[f"{l}.bias"])] for l in stage_layers[s]},
                           key, ps.endpoints(), timeout_s=300)
               for s in range(S)]
    if rate:
        burst = 256 << 10
        egress = [TokenBucket(rate, burst) for _ in range(S)]
        ingress = [TokenBucket(rate, burst) for _ in range(M)]
        for s, w in enumerate(workers):
            for f, c in w._clients.items():
                c.limiter = _limiter(egress[s], ingress[f])
    errors: list[str] = []

    def run(s: int) -> None:
        try:
            push_id = f"p{rnd}" if shared_push_id else f"p{rnd}-{s}"  # own id: no shared locks
            workers[s].push("c0", rnd, push_id, plans[s])
        except Exception as exc:  # reported below
            errors.append(f"stage {s}: {exc}")

    threads = [threading.Thread(target=run, args=(s,)) for s in range(S)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    for w in workers:
        w.close()
    for f in ps.leader.follower_list():
        f.control.discard(rnd)
    if errors:
        raise RuntimeError("; ".join(errors))
    return dt


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--rate-mb", type=float, default=100.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)

    import torch

    from dips.algo import greedy_schedule

    torch.set_num_threads(1)
    n_layers = S * 8
    owners = {f"blocks.{i}": i % M for i in range(n_layers)}
    model = harness.synthetic_model(n_layers, args.width, seed=0)
    nbytes = harness.wire_bytes(model)
    rate = args.rate_mb * 1e6
    print(f"{n_layers} layers, {nbytes / 1e6:.0f} MB BF16 per push; S={S} stage workers x "
          f"M={M} followers; links {'unshaped' if not rate else f'{args.rate_mb:.0f} MB/s per endpoint'}",
          flush=True)
    steps = greedy_schedule([list(range(s * 8, s * 8 + 8)) for s in range(S)],
                            {i: owners[f"blocks.{i}"] for i in range(n_layers)}, M)
    plans = {"schedule": [[] for _ in range(S)], "plain": []}
    for step in steps:
        for t in step:
            plans["schedule"][t.worker].append((f"blocks.{t.layer}", t.follower))
    plans["plain"] = [[(f"blocks.{i}", owners[f"blocks.{i}"]) for i in range(s * 8, s * 8 + 8)]
                      for s in range(S)]
    variants = {"schedule": ("schedule", True), "plain": ("plain", False),
                "plain+locks": ("plain", True)}
    ps = harness.PS(("synthetic", n_layers, args.width, 0), M, owners=owners)
    times: dict[str, list[float]] = {v: [] for v in variants}
    try:
        rnd = 0
        for r in range(-1, args.rounds):  # round -1 warms up (first touch), unmeasured
            for v, (plan, locks) in variants.items():
                rnd += 1
                dt = _push_once(ps, model, plans[plan], rnd, rate, locks)
                if r >= 0:
                    times[v].append(dt)
                print(f"  round {r} {v:12s}: {dt:.3f} s = {nbytes / dt / 1e6:.0f} MB/s", flush=True)
    finally:
        ps.close()
    med = {v: statistics.median(t) for v, t in times.items()}
    out = {"rate_mb_per_endpoint": args.rate_mb, "bytes": nbytes, "steps": len(steps),
           "seconds": med, "mb_per_s": {v: nbytes / t / 1e6 for v, t in med.items()},
           "speedup_schedule_vs_plain": med["plain"] / med["schedule"],
           "speedup_schedule_vs_plain_locks": med["plain+locks"] / med["schedule"]}
    ideal = M * args.rate_mb
    print(f"\n4. aggregate push throughput (median of {args.rounds}); "
          f"{'M x rate = ' + format(ideal, '.0f') + ' MB/s' if rate else 'unshaped'}")
    for v in variants:
        print(f"   {v:12s} {out['mb_per_s'][v]:7.0f} MB/s  ({med[v]:.3f} s)")
    print(f"   schedule vs plain order: {out['speedup_schedule_vs_plain']:.2f}x; "
          f"vs plain order with link locks: {out['speedup_schedule_vs_plain_locks']:.2f}x")
    print("RESULT " + json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
