"""Calibration of ``dips simulate`` against a real ``dips launch`` run (issue 16; seed §13).

:func:`measure` reads a finished run directory (the demo's, ``make calibrate-real``) and returns
a small JSON-able document: the run's shape (model, H, batch, grace, penalty, followers, each
cluster's slowdown and stage workers), the costs measured in it and the figures to compare.
:func:`from_real` maps that document to a :class:`dips.spec.simulate.SimScenario` charging those
costs; :func:`real_figures` gives the real figures in the form of
:func:`dips.sim.calibrate.figures`, so :func:`dips.sim.calibrate.ratios` compares the two.

Costs, all measured in the run (``clusters/<id>/train.jsonl``, ``outer_steps.jsonl``,
``leader_events.jsonl``):

* **inner step** per cluster: the mean and coefficient of variation of its steps' wall seconds
  up to the last decided step (the interval between consecutive step records, less the push,
  wait and pull seconds of a sync step): the injected §13 slowdown, the CPU the processes share
  and each sync step's inner checkpoint are in it;
* **transfers** per cluster: its mean measured push and pull seconds become its link rates
  (the wire bytes of the model / seconds); ``transfers="bench"`` charges instead ``make
  bench-dataplane``'s serialisation cost per byte (``bench_transfer``, BENCHMARKS.md);
* **update**: the leader's mean update phase (``round_end`` ``update_s``: score, decide,
  aggregate, apply and commit on every follower) / the model's parameters, followers called one
  after another as the leader calls them;
* **joins**: each cluster's first join, seconds after the first.

Not charged, recorded for the comparison: ``step_ratio_others_syncing`` per cluster, the mean
of its steps taken mostly while another cluster was in a sync over that of its other steps
(:func:`_coupling`; below 1 when a waiting cluster's CPU goes to the others, which the
simulation's independent step times do not model).

Compared (over the run up to its last decided step, whose accepted tokens are the simulated
run's token budget): the seconds from the first join to that step, the outer steps, and per
cluster the fraction of that time spent between a push request and the end of its pull (the
``push_s + wait_s + pull_s`` of ``train.jsonl``, the simulation's ``idle_frac``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dips.sim.calibrate import UNBOUNDED_NIC_BPS
from dips.sim.costs import layer_params, wire_bytes_per_param
from dips.spec.simulate import SimScenario
from dips.spec.training import ModelConfig

__all__ = ["BENCH_TRANSFER_S_PER_BYTE", "from_real", "measure", "real_figures"]

#: ``bench_transfer``'s data-plane CPU per wire byte, seconds (BENCHMARKS.md, ``make
#: bench-dataplane``, 2026-11-29: 0.83 ns/byte, 9.7 Gbit/s per core on this machine).
BENCH_TRANSFER_S_PER_BYTE = 0.83e-9


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _intervals(records: list[dict[str, Any]]) -> tuple[list[tuple[float, float]],
                                                      list[tuple[float, float]]]:
    """(its inner steps, its syncs) as (start, end) epoch seconds."""
    prev = next(r["time"] for r in records if r.get("event") == "join")
    steps, syncs = [], []
    for r in records:
        if "step" not in r:
            continue
        p = r.get("push")
        sync = (p["push_s"] + p["wait_s"] + p["pull_s"]) if p else 0.0
        steps.append((prev, r["time"] - sync))
        if p:
            syncs.append((r["time"] - sync, r["time"]))
        prev = r["time"]
    return steps, syncs


def _coupling(records: dict[str, list[dict[str, Any]]]) -> dict[str, float | None]:
    """Per cluster: the mean seconds of its steps spent mostly while another cluster was in a
    sync (push, wait, pull) / the mean of its other steps (1: the clusters' compute does not
    interact; < 1: a cluster waiting frees CPU for the others). The first step is left out."""
    spans = {c: _intervals(r) for c, r in records.items()}
    out: dict[str, float | None] = {}
    for c, (steps, _) in spans.items():
        others = [iv for o, (_, syncs) in spans.items() if o != c for iv in syncs]
        during, apart = [], []
        for a, b in steps[1:]:
            shared = sum(max(0.0, min(b, y) - max(a, x)) for x, y in others)
            (during if b > a and shared > (b - a) / 2 else apart).append(b - a)
        out[c] = (round(sum(during) / len(during) / (sum(apart) / len(apart)), 4)
                  if during and apart else None)
    return out


def _cluster(records: list[dict[str, Any]], start: float, t_last: float) -> dict[str, Any]:
    """One cluster's measured costs and its overhead seconds up to ``t_last`` (epoch s)."""
    join = next(r["time"] for r in records if r.get("event") == "join")
    steps = [r for r in records if "step" in r]
    durations, pushes, pulls, overhead, syncs = [], [], [], 0.0, 0
    prev = join
    for r in steps:
        p = r.get("push")
        sync = (p["push_s"] + p["wait_s"] + p["pull_s"]) if p else 0.0
        if r["time"] <= t_last:  # the steps of the period compared
            durations.append(r["time"] - prev - sync)
        prev = r["time"]
        if p:
            syncs += 1
            pushes.append(p["push_s"])
            pulls.append(p["pull_s"])
            overhead += max(0.0, min(r["time"], t_last) - max(r["time"] - sync, start))
    mean = sum(durations) / len(durations)
    var = sum((d - mean) ** 2 for d in durations) / len(durations)
    return {"join_s": round(join - start, 4), "steps": len(steps), "syncs": syncs,
            "step_s_mean": round(mean, 5), "step_s_cv": round(math.sqrt(var) / mean, 4),
            "push_s_mean": round(sum(pushes) / len(pushes), 5) if pushes else None,
            "pull_s_mean": round(sum(pulls) / len(pulls), 5) if pulls else None,
            "overhead_s": round(overhead, 4)}


def measure(run_dir: Path | str) -> dict[str, Any]:
    """The calibration document of the finished run in ``run_dir`` (module docstring).

    Raises FileNotFoundError for a missing output, ValueError if no step was decided."""
    run = Path(run_dir)
    cfg = json.loads((run / "config.json").read_text())
    ledger = json.loads((run / "leader.json").read_text())["ledger"]
    events = _jsonl(run / "leader_events.jsonl")
    start = min(e["time"] for e in events if e["event"] == "cluster_joined")
    decisions = [r for r in _jsonl(run / "outer_steps.jsonl") if "event" not in r]
    ends = [r for r in _jsonl(run / "outer_steps.jsonl") if r.get("event") == "round_end"]
    applied = [r for r in decisions if r["accepted"]]
    if not applied:
        raise ValueError(f"{run}: no outer step was decided")
    last = applied[-1]
    tokens = sum(r["tokens"][c] for r in applied for c in r["accepted"])
    span = last["time"] - start
    records = {c["id"]: _jsonl(run / "clusters" / c["id"] / "train.jsonl")
               for c in cfg["clusters"]}
    coupling = _coupling(records)
    clusters = {c["id"]: {"slowdown": c["slowdown"], "stages": c["stages"],
                          **_cluster(records[c["id"]], start, last["time"]),
                          "step_ratio_others_syncing": coupling[c["id"]]}
                for c in cfg["clusters"]}
    params = sum(p for _, p in layer_params(ModelConfig.model_validate(cfg["model"])))
    update_s = sum(r["update_s"] for r in ends) / len(ends)
    real = {"time_s": round(span, 4), "outer_steps": last["version"], "tokens_accepted": tokens,
            "pushes": sum(len(r["clusters"]) for r in decisions if r["time"] <= last["time"]),
            "rejected": sum(len(r["rejected"]) for r in decisions),
            "pushes_per_round": {str(n): sum(len(r["clusters"]) == n for r in decisions)
                                 for n in sorted({len(r["clusters"]) for r in decisions})},
            "idle_frac": {c: round(v["overhead_s"] / span, 5) for c, v in clusters.items()},
            "cluster_restarts": sum(e["event"] == "cluster_joined" and e.get("rejoin")
                                    for e in events),
            "removals": sum(e["event"] == "cluster_removed" for e in events),
            "followers_down": sum(e["event"] == "follower_down" for e in events)}
    keep = ("model", "inner", "outer", "penalty", "grace", "membership", "timeouts", "followers",
            "seed")
    return {"run": {k: cfg[k] for k in keep}, "params": params,
            "data": {"num_chunks": ledger["num_chunks"],
                     "windows_per_chunk": ledger["windows_per_chunk"]},
            "update_s_mean": round(update_s, 5), "rounds": len(ends),
            "clusters": clusters, "real": real}


def from_real(doc: dict[str, Any], transfers: str = "run", seed: int | None = None) -> SimScenario:
    """The simulation of the run measured in ``doc`` (:func:`measure`), charging its costs;
    ``transfers``: ``"run"`` (the run's push and pull seconds) or ``"bench"`` (bench_transfer's
    seconds per byte). Its token budget is the real run's accepted tokens at its last decided
    step. Raises ValueError for another ``transfers``, pydantic's error if invalid."""
    if transfers not in ("run", "bench"):
        raise ValueError(f"transfers = {transfers!r} must be 'run' or 'bench'")
    r = doc["run"]
    wire = doc["params"] * wire_bytes_per_param(r["outer"]["wire_dtype"])
    bench_bps = 8.0 / BENCH_TRANSFER_S_PER_BYTE
    clusters = []
    for cid, c in doc["clusters"].items():
        up = wire * 8.0 / c["push_s_mean"] if transfers == "run" else bench_bps
        down = wire * 8.0 / c["pull_s_mean"] if transfers == "run" else bench_bps
        clusters.append({"id": cid, "stages": c["stages"], "shared_links": c["stages"] > 1,
                         "step_s": c["step_s_mean"], "step_cv": c["step_s_cv"],
                         "windows_per_step": r["inner"]["batch_size"],
                         "uplink": {"bps": up}, "downlink": {"bps": down},
                         "join_s": c["join_s"], "initial_pull": False})
    t = r["timeouts"]
    sc = {"name": "calibrate-real", "seed": r["seed"] if seed is None else seed,
          "model": r["model"], "H": r["inner"]["H"], "outer": r["outer"], "penalty": r["penalty"],
          "leader": {"grace": r["grace"], "membership": r["membership"],
                     "timeouts": {k: t[k] for k in ("push_s", "pull_s", "push_slack",
                                                     "push_floor_s")},
                     "rpc_cpu_s": 0.0, "rpc_latency_s": 0.0},
          "followers": {"count": r["followers"], "nic_bps": UNBOUNDED_NIC_BPS,
                        "update_s_per_param": doc["update_s_mean"] / doc["params"],
                        "apply": "sequential"},
          "clusters": clusters, "norms": {"anomaly_prob": 0.0},
          "data": {"tokens_per_window": r["inner"]["seq_len"], **doc["data"]},
          "horizon_s": 10.0 * doc["real"]["time_s"] + 600.0,
          "token_budget": doc["real"]["tokens_accepted"]}
    return SimScenario.model_validate(sc)


def real_figures(doc: dict[str, Any]) -> dict[str, Any]:
    """The real run's figures in the form of :func:`dips.sim.calibrate.figures`."""
    real = doc["real"]
    return {"time_s": real["time_s"], "outer_steps": real["outer_steps"],
            "idle_frac": dict(real["idle_frac"]), "pushes": real["pushes"],
            "rejected": real["rejected"], "mean_staleness": None, "finished": "token budget"}
