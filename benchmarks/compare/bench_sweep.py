"""Di-PS against synchronous DiLoCo at equal tokens, across settings (issue 12; seed §14, §15).

For each setting of a sweep (an override of the scenario's ``outer``, ``penalty`` or ``inner``
section), runs Di-PS in virtual time on the η = 100 scenario and on chosen cluster counts of
the weak-scaling scenario, next to synchronous DiLoCo with the same override (DiLoCo only
where the override touches what it uses: ``inner``, ``outer.lr``/``momentum``), and prints the
final held-out loss of each with Di-PS's difference in percent (and, in the JSON, the mean of
the last three evaluations, ``tail_loss``: one evaluation moves by a few percent from one
outer step to the next at this scale). Virtual time makes every
figure independent of machine load (bit-reproducible); only the wall time depends on it.

Sweeps (``--sweep``): ``clip`` (the seed's fixed norm, none, relative ratios), ``staleness``,
``alpha`` and ``beta`` (§15's penalty values), ``H`` (inner steps per round). Writes
``OUT/<sweep>.json`` (every run) and ``OUT/<sweep>.md`` (the table).

Usage: python benchmarks/compare/bench_sweep.py --sweep clip [--counts 1,8,16] [--no-eta]
       [--out runs/sweep]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: sweep -> [(label, {section: {field: value}})]
SWEEPS: dict[str, list[tuple[str, dict[str, dict[str, Any]]]]] = {
    "clip": [("seed c=1", {"outer": {"clip": "seed", "max_norm": 1.0}}),
             ("none", {"outer": {"clip": "seed", "max_norm": None}}),
             ("relative 0.1", {"outer": {"clip": "relative", "clip_ratio": 0.1}}),
             ("relative 0.2", {"outer": {"clip": "relative", "clip_ratio": 0.2}}),
             ("relative 0.4", {"outer": {"clip": "relative", "clip_ratio": 0.4}})],
    "staleness": [("none", {"outer": {"staleness": "none"}}),
                  ("inverse", {"outer": {"staleness": "inverse"}}),
                  ("inverse, no clip", {"outer": {"staleness": "inverse", "clip": "seed",
                                                  "max_norm": None}})],
    "alpha": [(f"α={a}", {"penalty": {"alpha": a}}) for a in (0.01, 0.02, 0.05, 0.2, 0.5)],
    "beta": [(f"β={b}", {"penalty": {"beta": b}}) for b in (1.0, 3.0, 5.0, 10.0)],
    "H": [(f"H={h}", {"inner": {"H": h}}) for h in (8, 16, 32, 64)],
}
#: Sections (and outer fields) that change synchronous DiLoCo too.
DILOCO_FIELDS = {"inner": None, "outer": {"lr", "momentum"}}


def _override(sc: Any, change: dict[str, dict[str, Any]]) -> Any:
    update = {sec: getattr(sc, sec).model_copy(update=fields) for sec, fields in change.items()}
    return sc.model_copy(update=update)


def _touches_diloco(change: dict[str, dict[str, Any]]) -> bool:
    for sec, fields in change.items():
        if sec in DILOCO_FIELDS and (DILOCO_FIELDS[sec] is None or DILOCO_FIELDS[sec] & set(fields)):
            return True
    return False


def _run(sc: Any, method: str) -> dict[str, Any]:
    from dips.bench.runners import get_runner

    t0 = time.monotonic()
    r = get_runner("virtual", method)(sc, Path(tempfile.mkdtemp(prefix="sweep-")))
    tail = [p.eval_loss for p in r.curve[-3:]]
    return {"loss": r.final_eval_loss, "tail_loss": sum(tail) / len(tail),
            "tokens": r.tokens, "tokens_accepted": r.tokens_accepted,
            "time_s": r.time_s, "outer_steps": r.extra.get("outer_steps"),
            "wall_s": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from dips.spec import load_scenario

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", choices=sorted(SWEEPS), required=True)
    ap.add_argument("--counts", default="1,8,16", help="weak-scaling cluster counts")
    ap.add_argument("--no-eta", action="store_true", help="skip the η = 100 scenario")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "sweep")
    args = ap.parse_args(argv)
    cases = [(f"ws n={n}", load_scenario(ROOT / "configs/compare/weak-scaling.yaml").with_clusters(n))
             for n in (int(x) for x in args.counts.split(",") if x)]
    if not args.no_eta:
        cases.append(("η=100", load_scenario(ROOT / "configs/compare/eta100.yaml")))
    rows: list[dict[str, Any]] = []
    baseline: dict[str, dict[str, Any]] = {}
    for label, change in SWEEPS[args.sweep]:
        for case, sc in cases:
            s = _override(sc, change)
            key = case if not _touches_diloco(change) else f"{case} {label}"
            if key not in baseline:
                baseline[key] = _run(s, "diloco")
            dips = _run(s, "di-ps")
            ref = baseline[key]["loss"]
            row = {"setting": label, "case": case, "dips": dips, "diloco": baseline[key],
                   "diff_pct": 100.0 * (dips["loss"] - ref) / ref}
            rows.append(row)
            print(f"{label:18s} {case:8s} Di-PS {dips['loss']:.4f}  DiLoCo {ref:.4f}  "
                  f"{row['diff_pct']:+.2f}%  ({dips['outer_steps']} outer steps, "
                  f"wall {dips['wall_s']:.0f} s)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"sweep": args.sweep, "rows": rows}
    (args.out / f"{args.sweep}.json").write_text(json.dumps(doc, indent=1))
    names = [c for c, _ in cases]
    lines = [f"| {args.sweep} | " + " | ".join(names) + " |",
             "| --- | " + " | ".join("---:" for _ in names) + " |"]
    for label, _ in SWEEPS[args.sweep]:
        cells = []
        for c in names:
            r = next(x for x in rows if x["setting"] == label and x["case"] == c)
            cells.append(f"{r['dips']['loss']:.4f} ({r['diff_pct']:+.1f}%)")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    (args.out / f"{args.sweep}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("RESULT " + json.dumps({"sweep": args.sweep, "diff_pct": {
        f"{r['setting']} / {r['case']}": round(r["diff_pct"], 3) for r in rows}}), flush=True)
    return doc


if __name__ == "__main__":
    t0 = time.monotonic()
    main()
    print(f"({time.monotonic() - t0:.0f} s)")
