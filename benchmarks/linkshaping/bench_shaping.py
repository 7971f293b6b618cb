"""Link shaping in real-time mode: delivered rate against configured rate (issue 3, §13).

Measured in one run, on this machine:

1. Kernel shaping (root only): two cluster namespaces and the hub joined by veth
   (:class:`dips.emu.netns.ShapedNetwork`).  First the unshaped veth (the physical limit
   here), then for each configured rate a 3 s TCP transfer from a cluster to the hub: the
   payload rate the receiver sees, and delivered / configured.
2. Application token bucket (:class:`dips.wire.shaping.TokenBucket`, the non-root fallback):
   a TCP transfer over loopback whose sender calls ``consume`` before each 64 KiB write;
   delivered / configured, and the unshaped loopback rate as the limit.
3. A real-time synchronous DiLoCo run (2 clusters, 2 MiB padded payload, 50 Mbit links) under
   tc-tbf and under the token bucket: mean all-reduce seconds against the ring's ideal
   2 (N−1)/N × payload × 8 / rate.

Usage: python benchmarks/linkshaping/bench_shaping.py [--seconds 3] [--skip-baseline]
(``make bench-shaping``).  Prints a table and one JSON line (``RESULT {...}``).  Timings taken
while other work runs on the machine are noisy; the ratios come from the same run.
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import threading
import time
from pathlib import Path

from dips.emu import netns
from dips.emu.netprobe import measure_tcp_bps
from dips.wire.shaping import TokenBucket

ROOT = Path(__file__).resolve().parents[2]
def kernel_rates(rates_mbit: list[float], seconds: float) -> list[dict]:
    """Delivered TCP rate through a tbf'd veth (cluster → hub) for each configured rate."""
    rows = []
    with netns.ShapedNetwork(["a"], {"a": None}) as net:
        for mbit in [None, *rates_mbit]:
            net.set_rate("a", None if mbit is None else mbit * 1e6)
            got = measure_tcp_bps(net, "a", None, seconds) / 1e6
            rows.append({"shaping": "tc-tbf", "configured_mbit": mbit, "delivered_mbit": round(got, 2),
                         "ratio": None if mbit is None else round(got / mbit, 4)})
    return rows


def bucket_rates(rates_mbit: list[float], seconds: float) -> list[dict]:
    """Delivered TCP rate over loopback when the sender draws on a TokenBucket."""
    rows = []
    for mbit in [None, *rates_mbit]:
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.settimeout(30)
        got: dict = {}

        def receive() -> None:
            c, _ = srv.accept()
            c.settimeout(30)
            n, t0, t1 = 0, None, None
            while b := c.recv(1 << 20):
                t1 = time.monotonic()
                t0 = t0 or t1
                n += len(b)
            got["rate"] = n * 8 / (t1 - t0) / 1e6
            c.close()

        th = threading.Thread(target=receive)
        th.start()
        bucket = None if mbit is None else TokenBucket(mbit * 1e6 / 8, 65536)
        with socket.create_connection(srv.getsockname(), timeout=10) as c:
            buf, end = b"x" * 65536, time.monotonic() + seconds
            while time.monotonic() < end:
                if bucket is not None:
                    bucket.consume(len(buf))
                c.sendall(buf)
        th.join(30)
        srv.close()
        rows.append({"shaping": "token-bucket", "configured_mbit": mbit,
                     "delivered_mbit": round(got["rate"], 2),
                     "ratio": None if mbit is None else round(got["rate"] / mbit, 4)})
    return rows


def baseline_allreduce(shaping: str) -> dict:
    """Mean all-reduce seconds of a real-time DiLoCo run against the ring's ideal."""
    from dips.baselines.real_launch import launch_baseline
    from dips.spec import ClusterConfig, DataConfig, InnerConfig, LinkConfig, ModelConfig, WorkerSpec

    rate, payload = 50e6, 2 << 20
    spec = WorkerSpec(
        method="diloco", model=ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2,
                                           num_heads=4, num_kv_heads=2, vocab_size=512, max_seq_len=64),
        data=DataConfig(vocab_size=512, num_chunks=24, cache_dir=ROOT / ".cache/dips"),
        inner=InnerConfig(H=2, batch_size=4, seq_len=32, lr=0.003), token_budget=2 * 2 * 128 * 10,
        max_time_s=120, step_s=0.05, payload_bytes=payload, eval_batches=1, eval_batch_size=4,
        clusters=[ClusterConfig(id=c, link=LinkConfig(bps=rate)) for c in ("a", "b")])
    with tempfile.TemporaryDirectory() as tmp:
        res = launch_baseline(spec, Path(tmp), shaping=shaping)
    per = res.comm_s / res.updates_pushed
    ideal = 2 * (2 - 1) / 2 * payload * 8 / rate
    return {"shaping": res.shaping, "allreduce_s": round(per, 4), "ideal_s": round(ideal, 4),
            "ratio": round(per / ideal, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rates", type=float, nargs="+", default=[10.0, 100.0, 500.0])
    ap.add_argument("--skip-baseline", action="store_true")
    args = ap.parse_args()
    cap = netns.probe()
    rows = kernel_rates(args.rates, args.seconds) if cap.shaping == "tc-tbf" else []
    if not rows:
        print(f"kernel shaping unavailable: {cap.reason}")
    rows += bucket_rates(args.rates[:2], args.seconds)
    print(f"{'shaping':<14}{'configured Mbit/s':>20}{'delivered Mbit/s':>20}{'ratio':>9}")
    for r in rows:
        conf = "unshaped" if r["configured_mbit"] is None else f"{r['configured_mbit']:g}"
        print(f"{r['shaping']:<14}{conf:>20}{r['delivered_mbit']:>20.1f}{r['ratio'] or '':>9}")
    allreduce = []
    if not args.skip_baseline:
        modes = (["tc-tbf"] if cap.shaping == "tc-tbf" else []) + ["token-bucket"]
        allreduce = [baseline_allreduce(m) for m in modes]
        print("\nreal-time DiLoCo, 2 clusters, 2 MiB all-reduce at 50 Mbit/s:")
        for a in allreduce:
            print(f"  {a['shaping']:<13} all-reduce {a['allreduce_s']:.3f} s, ring ideal "
                  f"{a['ideal_s']:.3f} s, ratio {a['ratio']:.2f}")
    print("RESULT " + json.dumps({"links": rows, "allreduce": allreduce}))


if __name__ == "__main__":
    main()
