"""Projections of a Di-PS run to 64, 256 and 1,024 clusters (issue 16; seed §16, §17).

``python -m dips.sim.scale --out DIR [--days D] [--clusters 64,256,1024] [--models 100b,14b]
[--followers 32,64] [--search-h]`` (``make simulate-scale``) takes a base scenario per model (``configs/simulate/scale-100b.yaml``,
``scale-14b.yaml``: the §16 cluster types, links, costs and faults), multiplies its cluster
types to N clusters in the base's proportions, runs :func:`dips.sim.simulate` for each
(model, N, followers, H) of the grid, and writes ``scale.json``, ``scale.md`` (the table of
SCALE.md) and ``leader_load.png`` (leader messages per second and the largest per-cluster
overhead against clusters). Every run is seeded; the table is the same on every machine. The
wall and CPU seconds of each run are printed (not stored: they are the only figures that vary).

Per run: the leader's control messages per second (average, busiest 1-s bin, busiest from the
first push request on: :mod:`dips.sim.messages`), its CPU share at
``rpc_cpu_s`` per message, the largest per-cluster overhead (PS time / compute), the H that
would bring it under 5% (overhead per push is about constant, compute grows with H:
H × overhead / 5%; with ``--search-h`` also found by simulating, :func:`search_h`), staleness (mean, p95, max), the share of pushes the §8 penalty rejected
(no corrupted pushes in the model: staleness and noise alone), and a follower's peak memory
(bytes per parameter in the base file's ``followers.memory``).

Refused (exit 2, nothing run): a ``--followers`` count above a model's layer units (its layers
+ embedding + head: each follower owns at least one, :func:`layer_units`), and a ``--days``
shorter than one sync interval of a model's slowest cluster type (:func:`sync_interval_s`).
GRID's default counts above a model's layer units are capped, and the capped count is the
one named, run and reported (a line says so). A run whose horizon still held too little
(no outer step, or a cluster that completed no sync: :func:`dips.sim.report.horizon_answer`)
gets no H estimate, and its table row says why instead of a figure.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from dips.spec.simulate import SimScenario, load_sim_scenario

__all__ = ["GRID", "SEARCH_SYNCS", "chunks_for", "grid_followers", "layer_units", "plot_load",
           "run_grid", "scaled", "search_h", "sync_interval_s", "table"]

ROOT = Path(__file__).resolve().parents[3]
#: (clusters, followers) of the projections; capped at a model's layer units (grid_followers).
GRID = {64: (16, 32), 256: (32, 64), 1024: (64, 96)}


def layer_units(base: SimScenario) -> int:
    """The units the followers share (the model's layers + embedding + head): the most
    followers a run of ``base``'s model can have (each owns at least one)."""
    return base.model.num_layers + 2


def sync_interval_s(base: SimScenario) -> float:
    """Seconds of the H inner steps of ``base``'s slowest cluster type (step × §13 slowdown
    × H): a horizon shorter than this completes no sync of that type."""
    return max((c.H or base.H) * c.step_s * c.slowdown for c in base.clusters)


def grid_followers(base: SimScenario, clusters: int) -> tuple[list[int], str | None]:
    """GRID's follower counts for ``clusters`` clusters, capped at ``base``'s
    :func:`layer_units` (duplicates dropped), and a line saying what was capped (None:
    nothing)."""
    cap = layer_units(base)
    counts = sorted({min(m, cap) for m in GRID[clusters]})
    over = [m for m in GRID[clusters] if m > cap]
    note = None if not over else (
        f"{base.name}: GRID's {', '.join(map(str, over))} followers at {clusters} clusters "
        f"capped to {cap}, the model's layer units ({base.model.num_layers} layers + 2)")
    return counts, note


def chunks_for(types: list[Any], data: Any, horizon_s: float) -> int:
    """Data chunks enough for ``horizon_s`` seconds: what the cluster ``types`` could train
    if they never waited (windows per step / (step s × slowdown) each, in chunks of
    ``data.windows_per_chunk``) plus ``lease_ahead`` + 1 chunks per cluster being held, so a
    projection never runs out of data (an epoch ends only when every chunk is finished, and
    clusters holding theirs would stall the others: a figure of the data size, not the PS)."""
    windows = sum(c.count * c.windows_per_step * horizon_s / (c.step_s * c.slowdown)
                  for c in types)
    clusters = sum(c.count for c in types)
    return math.ceil(windows / data.windows_per_chunk) + (data.lease_ahead + 1) * clusters


def scaled(base: SimScenario, clusters: int, followers: int, days: float,
           H: int | None = None) -> SimScenario:
    """``base`` with its cluster types multiplied to ``clusters`` clusters (counts in the base's
    proportions, the remainder to the first type), ``followers`` followers, ``days`` simulated
    days and, if given, ``H`` inner steps per push; the chunks at least 8 × clusters and enough
    for the horizon (:func:`chunks_for`). Raises ValueError naming ``followers`` if it exceeds
    the model's :func:`layer_units` (never capped in silence)."""
    if followers > layer_units(base):
        raise ValueError(f"followers = {followers} exceeds the {layer_units(base)} layer units "
                         f"of {base.name}'s model ({base.model.num_layers} layers + embedding "
                         f"+ head; each follower owns at least one): at most "
                         f"{layer_units(base)}")
    counts = [c.count for c in base.clusters]
    total = sum(counts)
    new = [clusters * k // total for k in counts]
    new[0] += clusters - sum(new)
    types = [c.model_copy(update={"count": k}) for c, k in zip(base.clusters, new) if k]
    chunks = max(base.data.num_chunks, 8 * clusters, chunks_for(types, base.data, days * 86400.0))
    data = base.data.model_copy(update={"num_chunks": chunks})
    update: dict[str, Any] = {
        "name": f"{base.name}-n{clusters}-m{followers}" + (f"-h{H}" if H else ""),
        "clusters": types, "horizon_s": days * 86400.0, "data": data, "reference": None,
        "token_budget": None,  # a projection runs to its horizon
        "followers": base.followers.model_copy(update={"count": followers})}
    if H is not None:
        update["H"] = H
    return SimScenario.model_validate({**base.model_dump(), **{
        k: (v.model_dump() if hasattr(v, "model_dump") else
            [x.model_dump() for x in v] if isinstance(v, list) else v)
        for k, v in update.items()}})


#: Sync intervals (H inner steps of the slowest type) a run of :func:`search_h` covers at least.
SEARCH_SYNCS = 6


def search_h(base: SimScenario, clusters: int, followers: int, days: float,
             target: float = 0.05, resolution: float = 0.1, max_runs: int = 10,
             run: Any = None) -> dict[str, Any]:
    """The smallest H (found by simulating, not by the linear estimate) whose largest
    per-cluster overhead (PS time / compute) is below ``target``, for ``clusters`` clusters
    and ``followers`` followers. Each trial runs for ``days`` or :data:`SEARCH_SYNCS` sync
    intervals of the slowest type, whichever is longer (a large H syncs once a day or less),
    with its data sized for that horizon. Starts at the base's H; if that is over, tries the
    linear estimate H × overhead / target, doubles until under, then bisects until the
    bracket is within ``resolution`` (relative). The overhead is *not* monotone in H (rounds
    merge differently: 100B, 64 clusters, 16 followers: 4.23% at H = 136, 4.24% at 144; 256 /
    64: 5.89% at 171, 6.42% at 181), so a bisection can land in a dip: the answer is the
    smallest H tried that is under ``target`` with every larger H tried under too, confirmed
    by a trial one ``resolution`` step above it (over: the answer moves up, confirmed again),
    all within ``max_runs`` trials. ``run(sc)`` returns the largest overhead (default:
    :func:`dips.sim.simulate`).

    Returns ``{"H": that H (None: none under within max_runs), "H_min": the smallest H tried
    under target, "monotone": whether the trials' overheads fall with H, "over": {H: overhead
    of each trial}, "bracket": [largest H tried over below H, H]}``.
    """
    if run is None:
        from dips.sim import simulate

        def run(sc: SimScenario) -> float:  # a trial that answers nothing is not under
            doc = simulate(sc, plots=False)
            over = doc["overhead"]["added_time_frac_max"]
            return over if doc["horizon"]["answers"] and over is not None else math.inf

    slowest = max(c.step_s * c.slowdown for c in base.clusters)
    over: dict[int, float] = {}

    def trial(h: int) -> float:
        if h not in over:
            horizon = max(days, SEARCH_SYNCS * h * slowest / 86400.0)
            over[h] = run(scaled(base, clusters, followers, horizon, H=h))
        return over[h]

    def found() -> dict[str, Any]:
        hs = sorted(over)
        ok = [h for i, h in enumerate(hs) if all(over[g] < target for g in hs[i:])]
        h = ok[0] if ok else None
        below = [g for g in hs if over[g] >= target and (h is None or g < h)]
        return {"H": h, "H_min": min((g for g in hs if over[g] < target), default=None),
                "monotone": all(over[x] >= over[y] for x, y in zip(hs, hs[1:])),
                "over": over, "bracket": [below[-1] if below else None, h]}

    lo = base.H
    if trial(lo) < target:
        return found()
    hi = max(lo + 1, math.ceil(lo * over[lo] / target))
    while trial(hi) >= target:
        if len(over) >= max_runs:
            return found()
        lo, hi = hi, 2 * hi
    while hi - lo > max(1, resolution * lo) and len(over) < max_runs:
        mid = (lo + hi) // 2
        if trial(mid) < target:
            hi = mid
        else:
            lo = mid
    while len(over) < max_runs:  # confirm one step above the answer
        h = found()["H"]
        if h is None or math.ceil(h * (1 + resolution)) in over:
            break
        trial(math.ceil(h * (1 + resolution)))
        if found()["H"] == h:
            break
    return found()


def _row(model: str, sc: SimScenario, doc: dict[str, Any]) -> dict[str, Any]:
    lead, f, st = doc["leader"], doc["followers_summary"], doc["staleness"]
    over = doc["overhead"]["added_time_frac_max"] or 0.0
    answer = doc["horizon"]
    params = max(doc["model"]["params_per_follower"])
    return {"model": model, "clusters": sum(c.count for c in sc.clusters),
            "followers": sc.followers.count, "H": sc.H, "days": doc["simulated_s"] / 86400,
            "msg_avg": lead["msg_rate_avg"], "msg_peak": lead["msg_rate_peak"],
            "msg_peak_no_hb": lead["msg_rate_peak_no_heartbeats"],
            "msg_peak_after_start": lead["msg_rate_peak_after_start"],
            "leader_cpu": lead["cpu_frac"], "overhead_max": over,
            "overhead_mean": doc["overhead"]["added_time_frac_mean"],
            "clusters_without_push": len(doc["overhead"]["clusters_without_push"]),
            "answers": answer["answers"], "why": answer["why"], "syncs_min": answer["syncs_min"],
            "H_for_5pct": (None if not answer["answers"] else
                           math.ceil(sc.H * over / 0.05) if over > 0.05 else sc.H),
            "staleness_mean": st["mean"], "staleness_p95": st["p95"], "staleness_max": st["max"],
            "rejected_frac": doc["pushes"]["rejected_frac"], "pushes": doc["pushes"]["decided"],
            "withdrawn": doc["pushes"]["admission"]["withdrawn"],
            "pushes_withdrawn": doc["pushes"]["admission"]["pushes_withdrawn"],
            "outer_steps": doc["rounds"]["outer_steps"],
            "pushes_per_round": doc["rounds"]["pushes_per_round_mean"],
            "cpu_idle_min": f["cpu_idle_frac_min"], "link_peak_gbps": f["link_peak_bps"] / 1e9,
            "memory_peak_gb": f["memory_peak_bytes"] / 1e9,
            "memory_bytes_per_param": f["memory_peak_bytes"] / params}


def run_grid(models: list[str], clusters: list[int], days: float,
             out: Path | None = None, followers: list[int] | None = None,
             search: bool = False) -> list[dict[str, Any]]:
    """Run the grid (for each model in ``models`` and N in ``clusters``: the follower counts
    ``followers``, or :data:`GRID`'s for N); returns one row per run (see :func:`_row`; with
    ``search``, ``H_for_5pct_simulated`` and its trials from :func:`search_h`) and, with
    ``out``, writes scale.json and scale.md."""
    from dips.sim import simulate

    rows = []
    for model in models:
        base = load_sim_scenario(ROOT / "configs" / "simulate" / f"scale-{model}.yaml")
        for n in clusters:
            counts, note = (followers, None) if followers else grid_followers(base, n)
            if note:
                print(note, flush=True)
            for m in counts:
                sc = scaled(base, n, m, days)
                wall, cpu = time.perf_counter(), time.process_time()
                doc = simulate(sc, plots=False)
                row = _row(model, sc, doc)
                print(f"{sc.name}: {days:g} days in {time.perf_counter() - wall:.1f} s wall, "
                      f"{time.process_time() - cpu:.1f} s CPU"
                      + ("" if row["answers"] else f"; NOT ANSWERED: {row['why']}"), flush=True)
                if search:
                    found = search_h(base, n, m, days)
                    row["H_for_5pct_simulated"] = found["H"]
                    row["H_search_monotone"] = found["monotone"]
                    row["H_search"] = {str(h): o if math.isfinite(o) else None
                                       for h, o in sorted(found["over"].items())}
                    print(f"{sc.name}: H for < 5% (simulated) = {found['H']}, trials "
                          f"{row['H_search']}", flush=True)
                rows.append(row)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "scale.json").write_text(json.dumps(rows, indent=1) + "\n")
        (out / "scale.md").write_text(table(rows))
        plot_load(rows, out / "leader_load.png")
    return rows


def plot_load(rows: list[dict[str, Any]], path: Path) -> list[str]:
    """``leader_load.png``: against clusters (log scale), the leader's control messages per
    second (average and busiest second, heartbeats included) and the largest per-cluster
    overhead, one line per (model, followers) series of ``rows``. Returns the series' labels,
    in plotting order (rows with one cluster count still make a one-point series)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    series: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(rows, key=lambda r: (r["model"], r["followers"], r["clusters"])):
        series.setdefault(f"{r['model']}, {r['followers']} followers", []).append(r)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, rs in series.items():
        xs = [r["clusters"] for r in rs]
        line, = a1.plot(xs, [r["msg_avg"] for r in rs], "o-", label=f"{label}: average")
        a1.plot(xs, [r["msg_peak"] for r in rs], "^--", color=line.get_color(),
                label=f"{label}: busiest second")
        a2.plot(xs, [100 * r["overhead_max"] for r in rs], "o-", color=line.get_color(),
                label=label)
    for ax in (a1, a2):
        ax.set_xscale("log")
        ax.set_xlabel("clusters")
        ax.grid(alpha=0.3)
    a1.set_yscale("log")
    a1.set_ylabel("leader messages / s")
    a1.set_title("leader load")
    a1.legend(fontsize=7)
    a2.axhline(5, ls=":", color="k", lw=0.8, label="5% target")
    a2.set_ylabel("largest per-cluster overhead, % of compute")
    a2.set_title("PS time per cluster")
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return list(series)


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of ``rows`` (SCALE.md); a row whose horizon did not answer
    (``answers`` false) says why in place of its overhead, H, staleness and follower figures."""
    head = ("| model | clusters | followers | leader msg/s avg / peak (no heartbeats) / peak "
            "after the start | leader CPU "
            "| overhead max / mean | H for < 5% | staleness mean / p95 / max | rejected "
            "| pushes per round | follower CPU idle | link peak Gbit/s | follower peak memory |\n"
            "|" + " --- |" * 13 + "\n")
    return head + "\n".join(_line(r) for r in rows) + "\n"


def _line(r: dict[str, Any]) -> str:
    """One row of :func:`table`."""
    cells = [r["model"], r["clusters"], r["followers"],
             f"{r['msg_avg']:.2f} / {r['msg_peak']} ({r['msg_peak_no_hb']}) / "
             + ("n/a" if r.get("msg_peak_after_start") is None else f"{r['msg_peak_after_start']}"),
             f"{100 * r['leader_cpu']:.3f}%"]
    if not r.get("answers", True):
        cells += [f"n/a: {r['why']}"] + ["n/a"] * 7
        return "| " + " | ".join(map(str, cells)) + " |"
    never = r.get("clusters_without_push")
    cells += [f"{100 * r['overhead_max']:.2f}% / {100 * (r['overhead_mean'] or 0):.2f}%"
              + (f" ({never} never pushed)" if never else ""),
              f"{r['H_for_5pct']}" + (f" (simulated: {r['H_for_5pct_simulated']})"
                                      if "H_for_5pct_simulated" in r else ""),
              f"{r['staleness_mean']} / {r['staleness_p95']} / {r['staleness_max']}",
              f"{100 * r['rejected_frac']:.2f}%", r["pushes_per_round"],
              f"{100 * r['cpu_idle_min']:.1f}%", f"{r['link_peak_gbps']:.1f}",
              f"{r['memory_peak_gb']:.0f} GB ({r['memory_bytes_per_param']:.0f} B/param)"]
    return "| " + " | ".join(map(str, cells)) + " |"


def _ints(p: argparse.ArgumentParser, name: str, text: str) -> list[int]:
    """``text``'s comma-separated positive integers; ``p.error`` (exit 2) naming ``name``."""
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        p.error(f"argument {name}: {text!r}: give comma-separated positive integers")
    return out


def main(argv: list[str] | None = None) -> None:
    """The command line (module docstring)."""
    p = argparse.ArgumentParser(prog="python -m dips.sim.scale", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "simulate" / "scale")
    p.add_argument("--days", type=float, default=2.0, help="simulated days per run")
    p.add_argument("--clusters", default="64,256,1024", help="comma-separated, of 64,256,1024")
    p.add_argument("--models", default="100b,14b", help="comma-separated, of 100b,14b")
    p.add_argument("--followers", default=None,
                   help="comma-separated follower counts to try at every N (default: GRID's)")
    p.add_argument("--search-h", action="store_true",
                   help="also find the H that keeps the largest per-cluster overhead < 5%% by "
                        "simulating (search_h, up to 10 runs per row: the base H, the linear "
                        "estimate, doubling, bisecting to 10%%; the overhead is not monotone "
                        "in H, so the answer is the smallest H tried under 5%% with every "
                        "larger H tried under too, checked one 10%% step above)")
    a = p.parse_args(argv)
    follow = _ints(p, "--followers", a.followers) if a.followers else None
    clusters = _ints(p, "--clusters", a.clusters)
    if follow is None and set(clusters) - set(GRID):
        p.error(f"argument --clusters: {a.clusters!r}: without --followers each must be one "
                f"of {', '.join(map(str, GRID))} (GRID's follower counts)")
    models = a.models.split(",")
    for m in models:
        if not (ROOT / "configs" / "simulate" / f"scale-{m}.yaml").is_file():
            have = sorted(x.stem[6:] for x in (ROOT / "configs" / "simulate").glob("scale-*.yaml"))
            p.error(f"argument --models: {m!r}: no configs/simulate/scale-{m}.yaml "
                    f"(there are: {', '.join(have)})")
    if not (math.isfinite(a.days) and a.days > 0):
        p.error(f"argument --days: {a.days!r}: must be a positive number of simulated days")
    for m in models:
        base = load_sim_scenario(ROOT / "configs" / "simulate" / f"scale-{m}.yaml")
        big = [k for k in follow or [] if k > layer_units(base)]
        if big:
            p.error(f"argument --followers: {big[0]}: exceeds the {layer_units(base)} layer "
                    f"units of model {m} ({base.model.num_layers} layers + embedding + head; "
                    f"each follower owns at least one): at most {layer_units(base)}")
        least = sync_interval_s(base) / 86400.0
        if a.days < least:
            p.error(f"argument --days: {a.days!r}: shorter than one sync interval of model "
                    f"{m}'s slowest cluster type (H x step x slowdown = "
                    f"{sync_interval_s(base):.0f} s): no outer step could answer; at least "
                    f"{math.ceil(least * 1000) / 1000:g}")
    rows = run_grid(models, clusters, a.days, a.out, follow, a.search_h)
    print(table(rows))


if __name__ == "__main__":
    main()
