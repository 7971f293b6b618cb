"""Di-PS against synchronous DiLoCo at equal tokens, across settings (issue 12; seed §14, §15).

For each setting of a sweep (an override of the scenario's ``outer``, ``penalty`` or ``inner``
section), runs Di-PS in virtual time on the η scenarios (``configs/compare/eta<η>.yaml``) and on
chosen cluster counts of the weak-scaling scenario, next to synchronous DiLoCo with the same
override (DiLoCo only where the override touches what it uses: ``inner``, ``outer.lr``,
``momentum``, ``wire_dtype``), and prints the final held-out loss of each with Di-PS's
difference in percent, its speed-up over DiLoCo (time to the token budget) and, on weak
scaling, its throughput as a fraction of the ideal (independent clusters, no outer
communication; :func:`dips.emu.vclock.ideal_tokens`). The JSON also holds the mean of the last
three evaluations, ``tail_loss`` (one evaluation moves by a few percent from one outer step to
the next at this scale). Virtual time makes every figure independent of machine load
(bit-reproducible); only the wall time depends on it.

Sweeps (``--sweep``): ``defaults`` (the scenario as written: the done-when table of issue 12),
``clip`` (the seed's fixed norms 0.5-5, none, the relative threshold), ``staleness``,
``alpha`` and ``beta`` (§15's penalty values), ``H`` (inner steps per round), ``precision``
(§15: FP32 or BF16 on the wire, FP32 or BF16 optimizer state). ``--size large`` runs the
scenarios of ``configs/compare/large/`` (a 5.2M-parameter model; η = 100 and weak scaling
only). Writes ``OUT/<sweep>[-large].json`` (every run) and ``.md`` (the table).

Usage: python benchmarks/compare/bench_sweep.py --sweep clip [--counts 1,8,16] [--etas 100]
       [--size small|large] [--seed N] [--eval-batches N] [--jobs 2] [--reuse] [--replot] [--out runs/sweep]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

Change = dict[str, dict[str, Any]]
#: sweep -> [(label, {section: {field: value}})]
SWEEPS: dict[str, list[tuple[str, Change]]] = {
    "defaults": [("defaults", {})],
    "clip": [(f"seed c={c}", {"outer": {"clip": "seed", "max_norm": c}}) for c in (0.5, 1.0, 2.0, 5.0)]
    + [("none", {"outer": {"clip": "seed", "max_norm": None}})]
    + [(f"relative {r}", {"outer": {"clip": "relative", "clip_ratio": r}}) for r in (0.4,)],
    "staleness": [("none", {"outer": {"staleness": "none"}}),
                  ("inverse", {"outer": {"staleness": "inverse"}}),
                  ("inverse, no clip", {"outer": {"staleness": "inverse", "clip": "seed",
                                                  "max_norm": None}})],
    "alpha": [(f"α={a}", {"penalty": {"alpha": a}}) for a in (0.01, 0.02, 0.05, 0.2, 0.5)],
    "beta": [(f"β={b:g}", {"penalty": {"beta": b}}) for b in (1.0, 3.0, 5.0, 10.0)],
    "H": [(f"H={h}", {"inner": {"H": h}}) for h in (8, 16, 32, 64)],
    "precision": [("FP32 wire + FP32 outer", {"outer": {"wire_dtype": "fp32", "state_dtype": "fp32"}}),
                  ("BF16 wire + FP32 outer", {"outer": {"wire_dtype": "bf16", "state_dtype": "fp32"}}),
                  ("BF16 wire + BF16 outer", {"outer": {"wire_dtype": "bf16", "state_dtype": "bf16"}})],
}
#: Sections (and outer fields) that change synchronous DiLoCo too.
DILOCO_FIELDS = {"inner": None, "outer": {"lr", "momentum", "wire_dtype"}}


def _override(sc: Any, change: Change) -> Any:
    update = {sec: getattr(sc, sec).model_copy(update=fields) for sec, fields in change.items()}
    return sc.model_copy(update=update)


def _diloco_part(change: Change) -> Change:
    """The part of ``change`` synchronous DiLoCo uses (its runs are shared across the rest)."""
    out: Change = {}
    for sec, fields in change.items():
        if sec in DILOCO_FIELDS:
            keep = {k: v for k, v in fields.items() if DILOCO_FIELDS[sec] is None or k in DILOCO_FIELDS[sec]}
            if keep:
                out[sec] = keep
    return out


def _run(sc: Any, method: str) -> dict[str, Any]:
    import torch

    from dips.bench.runners import get_runner
    from dips.emu.vclock import ideal_tokens

    torch.set_num_threads(1)
    t0 = time.monotonic()
    r = get_runner("virtual", method)(sc, Path(tempfile.mkdtemp(prefix="sweep-")))
    tail = [p.eval_loss for p in r.curve[-3:]]
    tps = sc.inner.batch_size * sc.inner.seq_len
    ideal = ideal_tokens(sc.clusters, sc.timing.step_s, tps, r.time_s)
    return {"loss": r.final_eval_loss, "tail_loss": sum(tail) / len(tail),
            "tokens": r.tokens, "tokens_accepted": r.tokens_accepted,
            "time_s": r.time_s, "outer_steps": r.extra.get("outer_steps"),
            "frac_of_ideal": r.tokens / ideal if ideal else None,
            "curve": [(p.tokens, p.time_s, p.eval_loss) for p in r.curve],
            "wall_s": round(time.monotonic() - t0, 1)}


def _run_all(jobs: dict[str, tuple[Any, str]], store: Path, reuse: bool, workers: int,
             results: dict[str, dict[str, Any]]) -> None:
    """Run (or with ``reuse`` take from ``store``) every job into ``results``."""
    with ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = {k: pool.submit(_run, sc, m) for k, (sc, m) in jobs.items()
                   if not (reuse and _saved(store, sc, m).exists())}
        for k, (sc, m) in jobs.items():
            if k in futures:
                results[k] = futures[k].result()
                _saved(store, sc, m).write_text(json.dumps(results[k]))
            else:
                results[k] = json.loads(_saved(store, sc, m).read_text())
            print(f"{k}: loss {results[k]['loss']:.4f} ({results[k]['outer_steps']} outer steps, "
                  f"wall {results[k]['wall_s']:.0f} s)", flush=True)


def _one_round_more(sc: Any) -> Any:
    """``sc`` with the token budget one synchronous round larger (every cluster's H steps)."""
    round_tokens = len(sc.clusters) * sc.inner.H * sc.inner.batch_size * sc.inner.seq_len
    return sc.model_copy(update={"token_budget": sc.token_budget + round_tokens})


def _at_tokens(curve: list[list[float]], tokens: int) -> float:
    """DiLoCo's held-out loss at ``tokens``, linear between the evaluations around it.

    Di-PS's run ends at the update that brings its accepted tokens to the budget, and that
    update may merge several clusters' pushes: its final model can hold up to one round more
    than the budget (7% at 12 clusters). DiLoCo's loss one round further, interpolated at
    Di-PS's accepted tokens, compares the two at equal tokens in the model. ``curve``:
    (tokens, time, loss) points. Raises ValueError if ``tokens`` is beyond the curve.
    """
    for (t0, _, l0), (t1, _, l1) in zip(curve, curve[1:]):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / (t1 - t0) if t1 > t0 else l1
    raise ValueError(f"tokens = {tokens} outside the curve's {curve[0][0]}..{curve[-1][0]}")


def _saved(store: Path, sc: Any, method: str) -> Path:
    """Where the run of ``method`` on scenario ``sc`` is kept (``--reuse``): a hash of the
    scenario, for DiLoCo only of what it uses, so one DiLoCo run serves every Di-PS setting."""
    d = sc.model_dump(mode="json")
    if method == "diloco":
        d["outer"] = {k: d["outer"][k] for k in sorted(DILOCO_FIELDS["outer"])}
        for k in ("penalty", "grace", "methods"):
            d.pop(k, None)
    key = hashlib.sha256((method + json.dumps(d, sort_keys=True)).encode()).hexdigest()[:20]
    return store / f"{method}-{key}.json"


def _cases(size: str, counts: list[int], etas: list[int]) -> list[tuple[str, Any]]:
    from dips.spec import load_scenario

    base = ROOT / "configs" / "compare" / ("large" if size == "large" else "")
    ws = load_scenario(base / "weak-scaling.yaml")
    cases = [(f"ws n={n}", ws.with_clusters(n)) for n in counts]
    return cases + [(f"η={e}", load_scenario(base / f"eta{e}.yaml")) for e in etas]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", choices=sorted(SWEEPS), required=True)
    ap.add_argument("--counts", default="1,8,16", help="weak-scaling cluster counts ('' none)")
    ap.add_argument("--etas", default="100", help="η scenarios ('' none): 10, 50, 100, 200")
    ap.add_argument("--size", choices=("small", "large"), default="small")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel (one core each)")
    ap.add_argument("--seed", type=int, default=None,
                    help="the scenarios' seed (model initialisation, data order); default theirs")
    ap.add_argument("--eval-batches", type=int, default=None,
                    help="held-out batches per evaluation (default the scenario's; 16 = 8x the "
                         "weak-scaling set, 4x the eta scenarios')")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "sweep")
    ap.add_argument("--reuse", action="store_true",
                    help="take runs already in OUT/runs/ (keyed by scenario and method; virtual "
                         "runs are bit-reproducible, so only code changes make them stale)")
    ap.add_argument("--no-equal-tokens", dest="equal_tokens", action="store_false",
                    help="compare at the budget only (no DiLoCo run one round further)")
    ap.add_argument("--replot", action="store_true",
                    help="only redraw the table and plots from OUT/<sweep>[-large].json")
    args = ap.parse_args(argv)
    name = args.sweep + ("-large" if args.size == "large" else "") + \
        (f"-seed{args.seed}" if args.seed is not None else "") + \
        (f"-eval{args.eval_batches}" if args.eval_batches is not None else "")
    if args.replot:
        doc = json.loads((args.out / f"{name}.json").read_text())
        write_outputs(doc, args.out, name)
        return doc
    ints = lambda x: [int(v) for v in x.split(",") if v]  # noqa: E731
    cases = _cases(args.size, ints(args.counts), ints(args.etas))
    if args.seed is not None:
        cases = [(c, sc.model_copy(update={"seed": args.seed})) for c, sc in cases]
    if args.eval_batches is not None:
        cases = [(c, sc.model_copy(update={"eval_batches": args.eval_batches})) for c, sc in cases]
    # Every distinct run once: DiLoCo per (case, the part of the setting it uses).
    jobs: dict[str, tuple[Any, str]] = {}
    plan = []
    for label, change in SWEEPS[args.sweep]:
        for case, sc in cases:
            dkey = f"{case} diloco {json.dumps(_diloco_part(change), sort_keys=True)}"
            jobs.setdefault(dkey, (_override(sc, _diloco_part(change)), "diloco"))
            pkey = f"{case} di-ps {label}"
            jobs[pkey] = (_override(sc, change), "di-ps")
            plan.append((label, case, pkey, dkey))
    results: dict[str, dict[str, Any]] = {}
    store = args.out / "runs"
    store.mkdir(parents=True, exist_ok=True)
    run_all = lambda todo: _run_all(todo, store, args.reuse, args.jobs, results)  # noqa: E731
    run_all(jobs)
    # Where Di-PS's model holds more tokens than DiLoCo's, DiLoCo one round further, to read
    # its loss at Di-PS's tokens (_at_tokens).
    more = {dkey + " +1": (_one_round_more(jobs[dkey][0]), "diloco")
            for _, _, pkey, dkey in plan
            if args.equal_tokens and results[pkey]["tokens_accepted"] > results[dkey]["tokens"]}
    run_all(more)
    rows = []
    for label, case, pkey, dkey in plan:
        dips, ref = results[pkey], results[dkey]
        equal = (_at_tokens(results[dkey + " +1"]["curve"], dips["tokens_accepted"])
                 if dkey + " +1" in results else
                 ref["loss"] if dips["tokens_accepted"] == ref["tokens"] else None)
        rows.append({"setting": label, "case": case, "dips": dips, "diloco": ref,
                     "diloco_equal_tokens": equal,
                     "equal_diff_pct": None if equal is None else 100.0 * (dips["loss"] - equal) / equal,
                     "diff_pct": 100.0 * (dips["loss"] - ref["loss"]) / ref["loss"],
                     "tail_diff_pct": 100.0 * (dips["tail_loss"] - ref["tail_loss"]) / ref["tail_loss"],
                     "speedup": ref["time_s"] / dips["time_s"]})
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"sweep": args.sweep, "size": args.size, "rows": rows}
    (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    write_outputs(doc, args.out, name)
    print("RESULT " + json.dumps({"sweep": name, "equal_diff_pct": {
        f"{r['setting']} / {r['case']}": round(_diff(r), 3) for r in rows}}), flush=True)
    return doc


def write_outputs(doc: dict[str, Any], out: Path, name: str) -> None:
    """``out/<name>.md`` (the table), ``<name>.png`` (the differences) and, for a sweep of one
    setting, ``<name>-curves.png`` (held-out loss against tokens, Di-PS and DiLoCo per case)."""
    md = table(doc)
    (out / f"{name}.md").write_text(md)
    plot(doc, out / f"{name}.png")
    if len({r["setting"] for r in doc["rows"]}) == 1:
        curves(doc, out / f"{name}-curves.png")
    print(md)


def table(doc: dict[str, Any]) -> str:
    """Markdown: one row per setting, one column per case; each cell Di-PS's final loss, its
    difference in percent from DiLoCo's loss at the same tokens in the model (``_at_tokens``),
    then the speed-up (η) or fraction of ideal (weak scaling)."""
    rows = doc["rows"]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    lines = [f"| {doc['sweep']} | " + " | ".join(cases) + " |",
             "| --- | " + " | ".join("---:" for _ in cases) + " |"]
    for label in dict.fromkeys(r["setting"] for r in rows):
        cells = []
        for c in cases:
            r = next(x for x in rows if x["setting"] == label and x["case"] == c)
            speed = (f"{100 * r['dips']['frac_of_ideal']:.1f}% ideal" if c.startswith("ws")
                     else f"{r['speedup']:.2f}×")
            cells.append(f"{r['dips']['loss']:.4f} ({_diff(r):+.1f}%, {speed})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    first = {c: next(x for x in rows if x["case"] == c) for c in cases}
    if len({json.dumps(x["diloco"]["curve"]) for x in rows}) == len(cases):
        lines.append("| sync DiLoCo at the budget | "
                     + " | ".join(f"{first[c]['diloco']['loss']:.4f}" for c in cases) + " |")
    if len(rows) == len(cases) and all("diloco_equal_tokens" in r for r in rows):
        lines.append("| sync DiLoCo at Di-PS's tokens | " + " | ".join(
            "–" if first[c]["diloco_equal_tokens"] is None
            else f"{first[c]['diloco_equal_tokens']:.4f}" for c in cases) + " |")
        lines.append("| tokens in the model, Di-PS / DiLoCo | " + " | ".join(
            f"{first[c]['dips']['tokens_accepted'] / first[c]['diloco']['tokens']:.3f}"
            for c in cases) + " |")
    return "\n".join(lines) + "\n"


def _diff(r: dict[str, Any]) -> float:
    """Di-PS's loss against DiLoCo's at equal tokens, in percent (at the budget where that
    was not measured: ``--no-equal-tokens``)."""
    equal = r.get("equal_diff_pct")
    return r["diff_pct"] if equal is None else equal


def plot(doc: dict[str, Any], path: Path) -> None:
    """Grouped bars: Di-PS's final loss minus DiLoCo's, in percent, per case (x) and setting
    (bars); the ±0.5% band of issue 12 shaded. A run worse by more than 20% (a divergence) is
    drawn at the axis limit with its value written on it, so it never rescales the others."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    labels = list(dict.fromkeys(r["setting"] for r in rows))
    cap = 20.0
    fig, ax = plt.subplots(figsize=(max(6.0, len(cases) * (0.9 + 0.25 * len(labels))), 4.2))
    width = 0.8 / len(labels)
    for k, label in enumerate(labels):
        xs, ys, raw = [], [], []
        for i, c in enumerate(cases):
            r = next(x for x in rows if x["setting"] == label and x["case"] == c)
            xs.append(i + (k - (len(labels) - 1) / 2) * width)
            raw.append(_diff(r))
            ys.append(max(-cap, min(cap, _diff(r))))
        bars = ax.bar(xs, ys, width, label=label)
        for b, v in zip(bars, raw):
            if abs(v) > cap:
                ax.annotate(f"{v:+.0f}%", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom" if v > 0 else "top", fontsize=7)
    ax.axhspan(-0.5, 0.5, color="0.85", zorder=0, label="±0.5% of DiLoCo")
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xticks(range(len(cases)), cases, rotation=20, fontsize=8)
    ax.set_ylabel("Di-PS final loss vs sync DiLoCo\nat equal tokens (%, below 0: better)")
    ax.set_title(f"{doc['sweep']} ({doc['size']} model), equal tokens, virtual time")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def curves(doc: dict[str, Any], path: Path) -> None:
    """Final held-out loss of Di-PS and DiLoCo against the cluster count (weak scaling) and
    against η, then held-out loss against tokens for each η case; each y-axis spans what the
    runs reach after their first quarter of tokens, so the end of training is readable."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    ws = [r for r in rows if r["case"].startswith("ws")]
    eta = [r for r in rows if not r["case"].startswith("ws")]
    cols = max(2, len(eta))  # row 1: the two summaries; row 2: one curve per η
    fig, grid = plt.subplots(2 if eta else 1, cols, figsize=(3.6 * cols, 6.0 if eta else 3.0),
                             squeeze=False)
    axes = list(grid[0])
    for ax in axes[(1 if ws else 0) + (1 if eta else 0):] + list(grid[1][len(eta):] if eta else []):
        ax.axis("off")
    style = {"dips": ("o-", "Di-PS"), "diloco": ("s--", "sync DiLoCo")}
    for group, xlabel in ((ws, "clusters (weak scaling)"), (eta, "η (spread of slowdowns, %)")):
        if not group:
            continue
        ax = axes.pop(0)
        xs = [int(r["case"].split("=")[1]) for r in group]
        for key, (st, label) in style.items():
            ax.plot(xs, [r[key]["loss"] for r in group], st, label=label, ms=4)
        if all(r.get("diloco_equal_tokens") is not None for r in group):
            ax.plot(xs, [r["diloco_equal_tokens"] for r in group], "x:", ms=5,
                    label="sync DiLoCo at Di-PS's tokens")
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel("final held-out loss", fontsize=8)
        ax.set_xticks(xs)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7)
    for ax, r in zip(grid[1] if eta else [], eta):
        seen = []
        for key, (st, label) in style.items():
            pts = r[key]["curve"]
            ax.plot([p[0] / 1e6 for p in pts], [p[2] for p in pts], st[1:], label=label)
            seen += [p[2] for p in pts if p[0] >= pts[-1][0] / 4]
        lo, hi = min(seen), max(seen)
        ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
        ax.set_title(f"{r['case']}: Di-PS {_diff(r):+.1f}%", fontsize=9)
        ax.set_xlabel("tokens (M)", fontsize=8)
        ax.set_ylabel("held-out loss", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(f"{doc['sweep']} ({doc['size']} model): Di-PS vs synchronous DiLoCo at equal tokens",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.monotonic()
    main()
    print(f"({time.monotonic() - t0:.0f} s)")
