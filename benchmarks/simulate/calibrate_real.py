"""``make calibrate-real``: ``dips simulate`` against a real ``dips launch`` run (issue 16).

Runs the demo's config (configs/quickstart.yaml) for ``--max-time`` seconds of training (150 by
default: about 4 minutes of wall time on the 2-core machine), measures the run's costs and
figures (:func:`dips.sim.realrun.measure`), writes them to the fixture the test reads
(tests/sim/data/real_demo.json; ``tests/sim/test_calibration_real.py``), simulates the run with
those costs (:func:`dips.sim.realrun.from_real`: the run's push and pull seconds, and once
more with bench_transfer's seconds per byte) and prints simulated / real for time to the
token budget, outer steps and each cluster's idle fraction, for the fixture's seed and the
mean over ``--seeds`` seeds.

Usage: python benchmarks/simulate/calibrate_real.py [--max-time S] [--run-dir DIR]
       [--out FILE] [--reuse] [--seeds N]
(--reuse: measure an existing run in --run-dir instead of launching one.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from dips.sim import simulate
from dips.sim.calibrate import figures, ratios
from dips.sim.realrun import from_real, measure, real_figures

ROOT = Path(__file__).resolve().parents[2]


def _launch(config: Path, run_dir: Path, max_time: float) -> None:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    dips = Path(sys.executable).parent / "dips"
    cmd = [str(dips), "launch", "--config", str(config), "--run-dir", str(run_dir),
           "--max-time", str(max_time)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, timeout=max_time + 600, stdout=subprocess.DEVNULL)


def _row(name: str, r: dict[str, float]) -> str:
    return f"{name:>14}  " + "  ".join(f"{k} {v:.3f}" for k, v in r.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    ap.add_argument("--max-time", type=float, default=150.0, help="seconds of training")
    ap.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "calibrate-real")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "sim" / "data" / "real_demo.json")
    ap.add_argument("--reuse", action="store_true", help="measure the run already in --run-dir")
    ap.add_argument("--seeds", type=int, default=20, help="seeds for the mean ratios")
    a = ap.parse_args()
    load = None
    if not a.reuse:
        _launch(a.config, a.run_dir, a.max_time)
        load = [round(x, 2) for x in os.getloadavg()]  # 1, 5, 15 min, as the run ended
    doc = measure(a.run_dir)
    started = json.loads((a.run_dir / "events.jsonl").read_text().splitlines()[0])["time"]
    doc["source"] = {"config": str(a.config.relative_to(ROOT)) if a.config.is_relative_to(ROOT)
                     else str(a.config), "max_time_s": a.max_time,
                     "run_started": datetime.datetime.fromtimestamp(
                         started, datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                     "load_average_at_end": load, "command": "make calibrate-real"}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")
    real = real_figures(doc)
    print(f"real: {real['time_s']:.2f} s to {doc['real']['tokens_accepted']:,} accepted tokens, "
          f"{real['outer_steps']} outer steps, {real['pushes']} pushes, idle "
          + ", ".join(f"{c} {v:.4f}" for c, v in real["idle_frac"].items())
          + f"; pushes per round {doc['real']['pushes_per_round']}")
    print("steps while another cluster syncs / other steps: " + ", ".join(
        f"{c} {v['step_ratio_others_syncing']}" for c, v in doc["clusters"].items()))
    for transfers in ("run", "bench"):
        out = simulate(from_real(doc, transfers))
        sim = figures(out)
        print(f"simulated ({transfers} transfers, seed {doc['run']['seed']}): "
              f"{sim['time_s']:.2f} s, {sim['outer_steps']} outer steps, {sim['pushes']} pushes, "
              "idle " + ", ".join(f"{c} {v:.4f}" for c, v in sim["idle_frac"].items())
              + f"; pushes per round {out['rounds']['pushes_per_round']}")
        print(_row("sim / real", ratios(sim, real)))
        many = [ratios(figures(simulate(from_real(doc, transfers, seed=s))), real)
                for s in range(a.seeds)]
        mean = {k: statistics.mean(r[k] for r in many) for k in many[0]}
        spread = {k: statistics.pstdev(r[k] for r in many) for k in many[0]}
        print(_row(f"mean {a.seeds} seeds", mean))
        print(_row("std", spread))


if __name__ == "__main__":
    main()
