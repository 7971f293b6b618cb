"""Real time against virtual time on the same scenario (issue 3: two time modes, same dips/algo).

Runs ``configs/compare/eta100.yaml`` (4 clusters, η = 100, 10 Gbit links) with a shorter token
budget, once in virtual time (the runners of :mod:`dips.bench.runners`) and once in real time
(:mod:`dips.bench.real`: one process per cluster, calibrated steps, links shaped by tc tbf as
root or the token bucket), for the baselines and Di-PS (the processes of ``dips launch``, paced
and shaped alike).  Prints, per method, the real run's time converted to emulated seconds
(real / time_scale) against the virtual clock's time, the same for the outer communication
time, and both final validation losses.  A ratio near 1 says the virtual clock models what
real processes and real links do.

Usage: python benchmarks/linkshaping/bench_real_vs_virtual.py [--budget 262144 --time-scale 0.1]
(``make bench-real-vs-virtual``; ≈ 5 minutes on 2 cores).  Prints a table and ``RESULT {...}``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from dips.bench.compare import run_compare
from dips.spec import load_scenario

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", type=Path, default=ROOT / "configs/compare/eta100.yaml")
    ap.add_argument("--budget", type=int, default=262144)
    ap.add_argument("--time-scale", type=float, default=0.1)
    ap.add_argument("--methods", nargs="+", default=["diloco", "dp", "async-diloco", "di-ps"])
    args = ap.parse_args()
    base = load_scenario(args.scenario).model_dump(exclude={"eta", "n_clusters"})
    base.update(methods=args.methods, token_budget=args.budget, name=f"{base['name']}-rt")
    docs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("virtual", "real"):
            s = type(load_scenario(args.scenario)).model_validate(
                {**base, "mode": mode, "real": {**base["real"], "time_scale": args.time_scale}})
            docs[mode] = run_compare(s, Path(tmp) / mode)
    virt = {r["method"]: r for r in docs["virtual"]["results"]}
    rows = []
    print(f"{'method':<14}{'shaping':>13}{'time real/ts':>14}{'time virtual':>14}{'ratio':>8}"
          f"{'comm real/ts':>14}{'comm virtual':>14}{'loss real':>11}{'loss virtual':>14}")
    for r in docs["real"]["results"]:
        v = virt[r["method"]]
        t_emu, c_emu = r["time_s"] / args.time_scale, r["comm_s"] / args.time_scale
        row = {"method": r["method"], "shaping": r["shaping"], "time_real_emulated_s": round(t_emu, 2),
               "time_virtual_s": round(v["time_s"], 2), "time_ratio": round(t_emu / v["time_s"], 4),
               "comm_real_emulated_s": round(c_emu, 2), "comm_virtual_s": round(v["comm_s"], 2),
               "loss_real": round(r["final_eval_loss"], 4), "loss_virtual": round(v["final_eval_loss"], 4),
               "overruns": {k: c.get("overruns") for k, c in r["extra"].get("clusters", {}).items()}}
        rows.append(row)
        print(f"{row['method']:<14}{row['shaping']:>13}{t_emu:>14.1f}{v['time_s']:>14.1f}"
              f"{row['time_ratio']:>8.3f}{c_emu:>14.1f}{v['comm_s']:>14.1f}"
              f"{row['loss_real']:>11.4f}{row['loss_virtual']:>14.4f}")
    print("RESULT " + json.dumps({"time_scale": args.time_scale, "budget": args.budget, "rows": rows}))


if __name__ == "__main__":
    main()
