"""``make fuzz``: run each atheris target of fuzz/ for a fixed time (issue 13).

Each target gets a corpus under ``runs/fuzz/corpus/<target>`` (seeded with valid messages
the first time) and writes what crashes it to ``runs/fuzz/<target>-crash-*``. Prints, and
writes to ``runs/fuzz/summary.json``, the executions, the time and the findings per
target; exits 1 if any target found something.

Usage: python fuzz/run.py [--seconds 60] [--out runs/fuzz] [TARGET ...]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGETS = ("frames", "stream", "follower")


def run(target: str, seconds: int, out: Path) -> dict:
    script = HERE / f"fuzz_{target}.py"
    corpus = out / "corpus" / target
    if not corpus.is_dir() or not any(corpus.iterdir()):
        subprocess.run([sys.executable, str(script), "--seeds", str(corpus)], check=True)
    before = set(out.glob(f"{target}-*"))
    proc = subprocess.run([sys.executable, str(script), f"-max_total_time={seconds}",
                           "-timeout=30", "-rss_limit_mb=4096", "-print_final_stats=1",
                           f"-artifact_prefix={out}/{target}-", str(corpus)],
                          capture_output=True, text=True, timeout=seconds + 300)
    log = proc.stdout + proc.stderr
    (out / f"{target}.log").write_text(log)
    runs = re.findall(r"stat::number_of_executed_units:\s*(\d+)", log)
    done = re.findall(r"Done (\d+) runs in (\d+) second", log)
    added = re.findall(r"stat::new_units_added:\s*(\d+)", log)
    findings = sorted(str(p) for p in set(out.glob(f"{target}-*")) - before
                      if p.suffix != ".log")
    return {"target": target, "seconds": seconds, "exit": proc.returncode,
            "executions": int(runs[-1]) if runs else (int(done[-1][0]) if done else None),
            "new_units": int(added[-1]) if added else None,
            "corpus": sum(1 for _ in corpus.iterdir()), "findings": findings}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=60, help="per target (default 60)")
    ap.add_argument("--out", type=Path, default=Path("runs/fuzz"))
    ap.add_argument("targets", nargs="*", help=f"some of {', '.join(TARGETS)} (default: all)")
    args = ap.parse_args()
    unknown = set(args.targets) - set(TARGETS)
    if unknown:
        ap.error(f"unknown targets {sorted(unknown)}: choose from {list(TARGETS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for t in args.targets or TARGETS:
        r = run(t, args.seconds, args.out)
        results.append(r)
        print(f"{t}: {r['executions']} executions in {r['seconds']} s, {r['new_units']} new "
              f"units, corpus {r['corpus']}, "
              f"exit {r['exit']}, findings {r['findings'] or 'none'}", flush=True)
    (args.out / "summary.json").write_text(json.dumps(results, indent=2) + "\n")
    return 1 if any(r["findings"] or r["exit"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
