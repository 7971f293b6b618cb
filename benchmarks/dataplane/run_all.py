"""``make bench-dataplane``: the data-plane benchmarks of issues 5 and 11, one after the other.

Each benchmark runs in its own process (memory is returned between them), prints its own
table and ratios against a limit measured in the same run, and a ``RESULT {json}`` line;
this script collects them into ``runs/bench-dataplane/results.json`` and prints a summary.
About 11 minutes and < 4 GB of memory on the 2-core project machine.

Usage: python benchmarks/dataplane/run_all.py [--quick]   (--quick: smaller sizes, ~4 min)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _run(name: str, args: list[str], timeout_s: float) -> dict | None:
    cmd = [sys.executable, str(HERE / name), *args]
    print(f"\n=== {name} {' '.join(args)}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = None
    try:
        for line in proc.stdout:
            if line.startswith("RESULT "):
                result = json.loads(line[7:])
            elif "chttp2_transport" not in line:
                print(line, end="", flush=True)
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        print(f"   {name}: timed out after {timeout_s} s")
    print(f"   ({time.monotonic() - t0:.0f} s, exit {proc.returncode})", flush=True)
    return result


def _launch_has_grace() -> bool:
    """Whether ``dips launch`` passes the config's ``grace:`` section on to the leader (it does
    since the leader's settings are :meth:`dips.spec.LeaderConfig.from_run`)."""
    from dips.spec import LeaderConfig

    return hasattr(LeaderConfig, "from_run")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-dataplane/results.json"))
    args = ap.parse_args()
    q = args.quick
    t0 = time.monotonic()
    res = {
        "transfer": _run("bench_transfer.py", ["--layers", "6" if q else "12", "--rounds",
                                               "2" if q else "3"], 600),
        "update": _run("bench_update.py", ["--layers", "6" if q else "12"], 600),
        "multilink_shaped": _run("bench_multilink.py", ["--rate-mb", "50"], 600),
        "multilink_unshaped": _run("bench_multilink.py", ["--rate-mb", "0"], 600),
        "sync_overhead": _run("bench_sync_overhead.py", ["--max-time", "60" if q else "150"], 900),
        # The same with the dynamic window, once `dips launch` passes grace_mode to the leader.
        "sync_overhead_dynamic": _run("bench_sync_overhead.py", [
            "--max-time", "60" if q else "150", "--grace-mode", "dynamic",
            "--run-dir", "runs/bench-dataplane/sync-h64-dynamic"], 900) if _launch_has_grace() else None,
        "grace": _run("bench_grace.py", ["--seconds", "30" if q else "75"], 900),
        "secure": _run("bench_secure.py", ["--quick"] if q else [], 300),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"\n=== summary ({time.monotonic() - t0:.0f} s; details in {args.out})")
    t, u = res["transfer"], res["update"]
    if t:
        print(f"1. push+pull {t['push_pull_gbps']['stream']:.2f} GB/s = "
              f"{t['ratio_vs_raw_tcp']['stream']:.0%} of raw TCP {t['raw_tcp_gbps']:.2f} GB/s "
              f"(target >= 60%), {t['ratio_vs_zmq']['stream']:.0%} of ZeroMQ alone "
              f"{t['zmq_gbps']:.2f} GB/s")
        print(f"1. secure (mutual TLS, AES-GCM chunks) {t['push_pull_gbps']['secure']:.2f} GB/s = "
              f"{t['secure_vs_insecure']:.0%} of --insecure (target >= 90%), "
              f"{t['ratio_vs_raw_tcp']['secure']:.0%} of raw TCP (target >= 35%)")
    if u:
        print(f"2. follower update {u['follower_gbps']:.2f} GB/s of state = "
              f"{u['ratio_follower_vs_sgd']:.0%} of fused SGD {u['sgd_gbps']:.2f} GB/s (target >= 50%)")
    if t:
        print(f"3. outer loop {t['outer_loop_s']['single']:.3f} s naive -> "
              f"{t['outer_loop_s']['stream']:.3f} s pipelined = {t['speedup_stream_vs_single']:.2f}x "
              f"(paper 1.21x, target >= 1.5x)")
    for k in ("multilink_shaped", "multilink_unshaped"):
        m = res[k]
        if m:
            print(f"4. S=4 x M=4 ({'unshaped' if not m['rate_mb_per_endpoint'] else str(int(m['rate_mb_per_endpoint'])) + ' MB/s links'}): "
                  f"schedule {m['mb_per_s']['schedule']:.0f} MB/s vs plain order "
                  f"{m['mb_per_s']['plain']:.0f} MB/s = {m['speedup_schedule_vs_plain']:.2f}x")
    for k in ("sync_overhead", "sync_overhead_dynamic"):
        s = res[k]
        if s and s["max_share"] is not None:
            print(f"5. sync overhead at H=64, grace {s['grace_modes_seen']}: max {s['max_share']:.2%}, "
                  f"mean {s['mean_share']:.2%} of wall time per cluster (paper < 6%, target < 3%)")
    if res["sync_overhead_dynamic"] is None:
        print("5. (dynamic grace through dips launch skipped: the launcher does not pass "
              "grace_mode to the leader yet; see benchmark 6 for the dynamic window)")
    sec = res["secure"]
    if sec:
        m = sec["median_gbps"]
        print(f"7. one connection, 2 MiB chunks: CurveZMQ {m['4 CurveZMQ + ZAP']:.2f}, AES-GCM "
              f"{m['5b AES-GCM, encrypt_into ring']:.2f}, Poly1305 (insecure) "
              f"{m['3 ZeroMQ+Poly1305 (insecure)']:.2f}, raw TCP {m['1 raw TCP']:.2f} GB/s")
    g = res["grace"]
    if g:
        for w, r in g.items():
            print(f"6. grace {w:10s}: fast clusters idle {r['fast_idle_share']:.1%}, "
                  f"{r['outer_steps']} outer steps, mean staleness "
                  f"{'-' if r['mean_staleness'] is None else format(r['mean_staleness'], '.2f')}")


if __name__ == "__main__":
    main()
