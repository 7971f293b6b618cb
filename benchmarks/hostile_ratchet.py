"""What one member of three does to the honest steps and to §8's statistics (issue 13, review 30;
RELIABILITY.md, "Hostile input"), through the leader's update (``run_update``) with the rounds
of ``tests/roles/test_ratchet.py``: honest ‖Δ‖² log-normal around 1, the relative clip binding.

``ratchet``: the member multiplies its pseudo-gradient by k, k × 1.6 after each accepted push,
and leaves at its first refusal or 11th accepted push (review 30). ``edge``: it pushes the
largest ‖Δ‖² the aggregation takes whole (``push_norm_ratio``² × μ_robust, an honest-looking
push) for 150 rounds. Prints, per seed, each attack's accepted pushes, its steps during and
after it as a ratio to the same rounds without it (max, and the rounds over 1.1×), and the
maxima of μ, σ and the threshold against the run without it.

usage (repository root): PYTHONPATH=src python benchmarks/hostile_ratchet.py [seeds, e.g. 3,5]
(runs against an older src too)."""
import os
import sys

sys.path.insert(0, os.getcwd())
from tests.roles.test_ratchet import BEFORE, run  # noqa: E402


def summary(attacked: list[dict], control: list[dict]) -> str:
    ratios = [(a["phase"], a["step"] / c["step"]) for a, c in zip(attacked, control)][BEFORE:]
    during = [r for p, r in ratios if p == "attack"]
    after = [r for p, r in ratios if p == "after"]
    stats = ", ".join(f"{s} {max(a[s] for a in attacked):.3g} ({max(c[s] for c in control):.3g})"
                      for s in ("mu", "sigma", "threshold"))
    return (f"{len(during)} rounds; steps during ≤ {max(during):.3f}x, after ≤ {max(after):.3f}x "
            f"({sum(r > 1.1 for r in after)} of {len(after)} over 1.1x); max {stats}")


for seed in [int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "3,5").split(",")]:
    control = run(seed, "control", 150)
    print(f"seed {seed} ratchet: {summary(run(seed, 'ratchet'), control)}", flush=True)
    print(f"seed {seed} edge:    {summary(run(seed, 'edge', 150), control)}", flush=True)
