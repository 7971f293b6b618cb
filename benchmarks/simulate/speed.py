"""The simulator's speed at scale (SCALE.md "Engine speed"): one projection run, its CPU seconds
and a digest of its simulate.json (same seed, same digest).

``python benchmarks/simulate/speed.py --days 0.7 --clusters 1024 --followers 96``
(``configs/simulate/scale-100b.yaml`` scaled as ``python -m dips.sim.scale`` does); under
``python -m cProfile -s tottime`` for the hot spots.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

from dips.sim import simulate
from dips.sim.scale import ROOT, scaled
from dips.spec.simulate import load_sim_scenario


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--days", type=float, default=0.7, help="simulated days")
    p.add_argument("--clusters", type=int, default=1024)
    p.add_argument("--followers", type=int, default=96)
    p.add_argument("--model", default="100b", help="100b or 14b")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    base = load_sim_scenario(ROOT / "configs" / "simulate" / f"scale-{a.model}.yaml")
    sc = scaled(base.model_copy(update={"seed": a.seed}), a.clusters, a.followers, a.days)
    cpu = time.process_time()
    doc = simulate(sc, plots=False)
    cpu = time.process_time() - cpu
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()
    print(f"{sc.name}: {a.days:g} days, {cpu:.1f} s CPU, simulate.json sha256 {digest[:16]}, "
          f"{doc['rounds']['outer_steps']} outer steps, {doc['pushes']['decided']} pushes, "
          f"overhead max {doc['overhead']['added_time_frac_max']:.4f}")


if __name__ == "__main__":
    main()
