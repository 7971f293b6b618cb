"""Di-PS against data parallel, synchronous DiLoCo and naive async DiLoCo, in virtual time
(issue 3; seed §13–§15).  Run by ``make bench-compare``.

Runs the comparison scenarios of ``configs/compare/`` (η = 10, 50, 100, 200 on four clusters,
a slow link, weak scaling 1 → 16 clusters) through ``dips bench compare``'s code, writing each
into ``runs/compare/<scenario>/`` (compare.json, compare.md, plots), then prints the headline
ratios, each against a figure measured in the same run:

* η = 100: Di-PS's speedup to the token budget against synchronous DiLoCo (target ≥ 1.3×) and
  its final validation loss against DiLoCo's (target: within 2%);
* η ≥ 100: naive async DiLoCo's final loss against Di-PS's;
* weak scaling at 16 clusters: Di-PS's aggregate tokens/s as % of the ideal of independent
  clusters without outer communication (target ≥ 97%), synchronous DiLoCo's beside it.

Virtual time makes every figure independent of machine load (bit-reproducible); only the wall
time of the run depends on it.  Usage: ``python benchmarks/compare/bench_compare.py
[--only eta100,slow-link] [--out runs/compare] [--jobs 2]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Longest first, so that two parallel jobs finish at about the same time.
SCENARIOS = ["eta100", "weak-scaling", "eta200", "slow-link", "eta10", "eta50"]


def _run(name: str, out_root: Path) -> dict:
    from dips.bench.compare import run_compare, run_weak_scaling
    from dips.spec import load_scenario

    sc = load_scenario(ROOT / "configs" / "compare" / f"{name}.yaml")
    out = out_root / name
    t0 = time.monotonic()

    def report(label: str, event: str, payload: object) -> None:
        if event == "done":
            print(f"  {name}: {label:<24} {payload.tokens_per_s:9,.1f} tok/s  time "
                  f"{payload.time_s:8.1f} s  loss {payload.final_eval_loss:.4f}  "
                  f"(wall {payload.extra.get('wall_s', 0):.0f} s)", flush=True)

    run = run_weak_scaling if sc.kind == "weak-scaling" else run_compare
    doc = run(sc, out, report)
    print(f"  {name}: done in {time.monotonic() - t0:.0f} s wall -> {out}/compare.md", flush=True)
    return doc


def _by_method(doc: dict) -> dict[str, dict]:
    return {r["method"]: r for r in doc["results"]}


def headline(docs: dict[str, dict]) -> list[str]:
    """The issue's target figures from the finished runs (missing scenarios are skipped)."""
    lines = []
    for name in ("eta10", "eta50", "eta100", "eta200", "slow-link"):
        if name not in docs:
            continue
        r, d = _by_method(docs[name]), docs[name]["derived"]
        if "di-ps" in r and "diloco" in r:
            lines.append(f"{name}: Di-PS speedup vs sync DiLoCo {d['di-ps']['speedup_vs_diloco']:.2f}x "
                         f"(time {r['di-ps']['time_s']:.0f} s vs {r['diloco']['time_s']:.0f} s); "
                         f"final loss {r['di-ps']['final_eval_loss']:.4f} vs "
                         f"{r['diloco']['final_eval_loss']:.4f} "
                         f"({d['di-ps']['loss_diff_vs_diloco_pct']:+.2f}%)")
        if "async-diloco" in r and "di-ps" in r:
            a, p = r["async-diloco"]["final_eval_loss"], r["di-ps"]["final_eval_loss"]
            lines.append(f"{name}: naive async DiLoCo final loss {a:.4f} vs Di-PS {p:.4f} "
                         f"({100 * (a - p) / p:+.2f}%), speedup vs DiLoCo "
                         f"{d['async-diloco']['speedup_vs_diloco']:.2f}x")
        if "dp" in r:
            lines.append(f"{name}: data parallel speedup vs DiLoCo {d['dp']['speedup_vs_diloco']:.2f}x, "
                         f"final loss {r['dp']['final_eval_loss']:.4f}")
    for name, doc in docs.items():
        if doc.get("kind") != "weak-scaling":
            continue
        pts = doc["points"]
        n = max(p["clusters"] for p in pts)
        for p in sorted((p for p in pts if p["clusters"] == n), key=lambda p: p["method"]):
            lines.append(f"{name} n={n}: {p['method']} {p['tokens_per_s']:,.1f} tok/s = "
                         f"{100 * p['frac_of_ideal']:.1f}% of ideal {p['ideal_tokens_per_s']:,.1f}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenario names")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "compare")
    ap.add_argument("--jobs", type=int, default=2, help="scenarios run in parallel processes")
    ap.add_argument("--report-only", action="store_true",
                    help="print the headline of runs already in --out, without running")
    args = ap.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    t0 = time.monotonic()
    docs = {}
    if args.report_only:  # re-read finished runs instead of running them
        for name in names:
            docs[name] = json.loads((args.out / name / "compare.json").read_text())
    elif args.jobs <= 1:
        for name in names:
            print(f"scenario {name}", flush=True)
            docs[name] = _run(name, args.out)
    else:  # scenarios are independent and single-threaded: one process per core
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
            futures = {name: pool.submit(_run, name, args.out) for name in names}
            for name, fut in futures.items():
                docs[name] = fut.result()
    lines = headline(docs)
    print("\n== headline (virtual time; bit-reproducible) ==")
    for line in lines:
        print(line)
    print(f"total wall time {time.monotonic() - t0:.0f} s")
    (args.out / "headline.json").write_text(json.dumps({"lines": lines}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
