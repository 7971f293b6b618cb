"""``simulate.json``: the figures of a simulated run (seconds, bytes, bits/s, messages/s).

* ``clusters``: per cluster, seconds per state (:mod:`dips.sim.member`), the PS's overhead
  (admit + push + verdict + pull) as ``added_time_frac`` = overhead / compute seconds (§16:
  "Di-PS adds less than ~6% to each cluster's time") and ``overhead_frac`` = overhead /
  (compute + overhead), ``idle_frac`` = overhead / run seconds (the virtual-time engine's
  idle fraction), pushes, verdicts, faults, mean push and pull seconds.
* ``followers``: per follower, ``idle_frac`` = 1 − (seconds its CPU ran an outer step or its
  NIC moved data, their union) / run seconds, ``cpu_busy_frac``, ``nic_busy_frac``, peak NIC
  rate per direction (bits/s; the fluid model's rates are piecewise constant, so this is the
  exact peak), bytes moved, peak memory (bytes).
* ``leader``: the control messages the leader receives (:mod:`dips.sim.messages`): one per
  RPC, the requests of calls into it (JoinCluster, GetSpec, RequestPush, PushDone, PullDone,
  Lease, a cluster's Heartbeat, a follower's RegisterFollower) and the replies of its calls
  to followers (Score, Aggregate or Discard, Apply, Commit, Abort, Restore, GetState, Fence),
  each when it arrives; heartbeats at the times the protocol gives them (a cluster every
  interval from a drawn offset after its join, a follower at its start and every interval
  from a drawn offset after it). ``msg_rate_peak``: the busiest 1-s bin
  of the run, all messages, at ``msg_rate_peak_at_s`` (the start-up's specs, joins, leases and
  first reconciliation, if all members start together); ``msg_rate_peak_after_start``: the
  busiest 1-s bin from the first RequestPush on; ``cpu_frac``: messages ×
  ``rpc_cpu_s`` / run seconds.
* ``server_faults``: follower and leader faults (:mod:`dips.sim.faults`): outer steps rolled
  back, leader restarts, clusters that re-joined for a push the restarted leader did not know,
  the random (MTBF) follower faults and leader crashes (:mod:`dips.sim.faults`), and
  the first 100 events (seconds, what, details).
* ``horizon``: whether the run's horizon held enough to answer: ``answers`` is true when at
  least one outer step was kept and every cluster completed a sync (push, verdict, pull);
  else ``why`` says what was missing (a per-cluster overhead, a staleness or an H for a
  target from a horizon of no complete sync would be a figure of the start, not of the run).
  ``syncs_min``: the fewest syncs a cluster completed; ``clusters_without_sync``.
* ``rounds``, ``staleness`` (versions applied between a push's base and its update),
  ``pushes`` (verdicts, rejections by reason), ``tokens``, ``model``, and ``reference``: each
  figure of the scenario's reference next to the simulated one, their ratio and whether it is
  within the tolerance. ``pushes.admission``: requests withdrawn at their admission deadline
  (``timeouts.admit_s``) and asked again (:mod:`dips.sim.rounds`), the pushes that were, and
  the most requests one push took.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from dips.sim.engine import Simulation
from dips.sim.member import OVERHEAD

__all__ = ["horizon_answer", "summarize"]


def _r(x: float, digits: int = 6) -> float:
    return float(f"{x:.{digits}g}")


def _percentile(hist: Counter[int], q: float) -> int:
    n = sum(hist.values())
    seen = 0
    for k in sorted(hist):
        seen += hist[k]
        if seen >= q * n:
            return k
    return 0


def _mean(xs: list[float]) -> float | None:
    return _r(sum(xs) / len(xs)) if xs else None


def _clusters(sim: Simulation) -> dict[str, Any]:
    out, T = {}, sim.end_s or 1.0
    for cid, m in sim.members.items():
        tot = m.totals
        compute = tot.get("compute", 0.0)
        overhead = sum(tot.get(s, 0.0) for s in OVERHEAD)
        out[cid] = {
            "compute_s": _r(compute), "overhead_s": _r(overhead),
            "added_time_frac": _r(overhead / compute) if compute else None,
            "overhead_frac": _r(overhead / (compute + overhead)) if compute + overhead else None,
            "idle_frac": _r(overhead / T),
            "state_s": {k: _r(v) for k, v in sorted(tot.items())},
            "pushes": m.push_no, "accepted": m.accepted, "rejected": m.rejected,
            "faults": m.faults, "tokens_accepted": m.tokens_accepted,
            "requests_withdrawn": m.retries,
            "push_s_mean": _mean(m.push_s), "pull_s_mean": _mean(m.pull_s)}
    return out


def _followers(sim: Simulation) -> list[dict[str, Any]]:
    T = sim.end_s or 1.0
    return [{"index": f.index, "params": f.params, "idle_frac": _r(1.0 - f.busy_s / T),
             "cpu_busy_frac": _r(f.cpu_s / T), "nic_busy_frac": _r(f.nic_s / T),
             "peak_bps": {k: _r(v) for k, v in f.peak_bps.items()},
             "bytes": {k: _r(v) for k, v in f.bytes.items()},
             "memory_peak_bytes": _r(f.memory_peak_bytes)} for f in sim.loads]


def _leader(sim: Simulation) -> dict[str, Any]:
    sc, T = sim.sc, sim.end_s or 1.0
    other = np.zeros(max(int(T), max(sim.bins, default=0)) + 1, dtype=np.int64)
    if sim.bins:
        keys = np.fromiter(sim.bins.keys(), dtype=np.int64, count=len(sim.bins))
        other[keys] = np.fromiter(sim.bins.values(), dtype=np.int64, count=len(sim.bins))
    beats, hist = sim.beats.histogram(T, len(other))
    total_hist = other + hist
    peak_at = int(np.argmax(total_hist))
    steady = total_hist[int(sim.first_request_s):] if sim.first_request_s is not None else None
    steady_at = (int(sim.first_request_s) + int(np.argmax(steady))
                 if steady is not None and len(steady) else None)
    total = sum(sim.msgs.values()) + sum(beats.values())
    by_kind = dict(sorted({**sim.msgs, **beats}.items()))
    clusters = Counter(sim.bins)
    clusters.subtract(sim.follower_bins)
    return {"messages": int(total), "by_kind": by_kind, "msg_rate_avg": _r(total / T),
            "msg_rate_peak": int(total_hist[peak_at]), "msg_rate_peak_at_s": peak_at,
            "msg_rate_peak_window_s": 1,
            "msg_rate_peak_after_start": None if steady_at is None else int(total_hist[steady_at]),
            "msg_rate_peak_after_start_at_s": steady_at,
            "msg_rate_peak_no_heartbeats": int(other.max()),
            "msg_rate_peak_heartbeats": int(hist.max()),
            "msg_rate_peak_from_clusters": max(clusters.values(), default=0),
            "msg_rate_peak_to_followers": max(sim.follower_bins.values(), default=0),
            "heartbeat_rate": _r(sum(beats.values()) / T),
            "cpu_frac": _r(total * sc.leader.rpc_cpu_s / T)}


def _reference(sim: Simulation, doc: dict[str, Any]) -> dict[str, Any] | None:
    ref = sim.sc.reference
    if ref is None:
        return None
    simulated = {"added_time_frac": doc["overhead"]["added_time_frac_max"],
                 "follower_idle_frac": doc["followers_summary"]["idle_frac_min"],
                 "follower_link_peak_bps": doc["followers_summary"]["link_peak_bps"],
                 "leader_msg_rate_avg": doc["leader"]["msg_rate_avg"],
                 "leader_msg_rate_peak": doc["leader"]["msg_rate_peak"]}
    out: dict[str, Any] = {"source": ref.source, "tolerance": ref.tolerance, "figures": {}}
    for name, value in simulated.items():
        paper = getattr(ref, name)
        if paper is None or value is None:
            continue
        ratio = value / paper
        out["figures"][name] = {"paper": paper, "simulated": value, "ratio": _r(ratio, 4),
                                "within": abs(ratio - 1.0) <= ref.tolerance}
    return out


def horizon_answer(outer_steps: int, syncs: dict[str, int], horizon_s: float) -> dict[str, Any]:
    """Whether a run of ``horizon_s`` seconds that kept ``outer_steps`` outer steps, its
    clusters completing ``syncs`` (cluster -> syncs pushed, decided and pulled), answers
    what a projection asks (the per-cluster overhead, staleness, the H for a target): at
    least one outer step and a completed sync of every cluster (``answers``); ``why`` names
    what was short, in words a reader of the output sees (None when it answers)."""
    missing = sorted(c for c, n in syncs.items() if n == 0)
    why = None
    if not outer_steps:
        why = (f"the horizon ({horizon_s:.6g} s) holds no outer step: too short to answer "
               "(no overhead, staleness or H figure)")
    elif missing:
        why = (f"the horizon ({horizon_s:.6g} s) is too short to answer: {len(missing)} of "
               f"{len(syncs)} clusters completed no sync (push, verdict, pull)")
    return {"answers": why is None, "why": why, "outer_steps": outer_steps,
            "syncs_min": min(syncs.values(), default=0), "clusters_without_sync": missing}


def summarize(sim: Simulation) -> dict[str, Any]:
    """The JSON-able document of ``sim`` (after :meth:`Simulation.run`); see the module
    docstring. Deterministic: no wall-clock time, sorted keys where order is not given."""
    sc, T = sim.sc, sim.end_s
    clusters = _clusters(sim)
    added = [c["added_time_frac"] for c in clusters.values() if c["added_time_frac"] is not None]
    followers = _followers(sim)
    lags = sim.lags
    n_lags = sum(lags.values())
    doc: dict[str, Any] = {
        "scenario": sc.name, "seed": sc.seed, "simulated_s": _r(T), "finished": sim.finished,
        "model": {"params": sim.params, "layers": len(sim.layer_bytes),
                  "wire_bytes": _r(sum(sim.layer_bytes)), "wire_dtype": sc.outer.wire_dtype,
                  "followers": sc.followers.count, "params_per_follower": sim.follower_params},
        "clusters": clusters,
        # A cluster that never pushed has no sync time to add: listed, so that a maximum over
        # the others does not read as a healthy run (review 27).
        "overhead": {"added_time_frac_max": max(added, default=None),
                     "added_time_frac_mean": _mean(added),
                     "clusters_without_push": sorted(c for c, v in clusters.items()
                                                     if not v["pushes"])},
        "followers": followers,
        "followers_summary": {
            "idle_frac_min": min(f["idle_frac"] for f in followers),
            "idle_frac_mean": _mean([f["idle_frac"] for f in followers]),
            "cpu_busy_frac_max": max(f["cpu_busy_frac"] for f in followers),
            "cpu_idle_frac_min": _r(1.0 - max(f["cpu_busy_frac"] for f in followers)),
            "link_peak_bps": max(max(f["peak_bps"].values()) for f in followers),
            "nic_bps": sc.followers.nic_bps,
            "memory_peak_bytes": max(f["memory_peak_bytes"] for f in followers)},
        "leader": _leader(sim),
        "rounds": {"rounds": sim.counts["rounds"], "outer_steps": sim.version,
                   "pushes_per_round": {str(k): v for k, v in sorted(sim.round_sizes.items())},
                   "pushes_per_round_mean": _mean([k for k, v in sim.round_sizes.items()
                                                   for _ in range(v)]),
                   "first": sim.rounds[:50]},
        "staleness": {"histogram": {str(k): v for k, v in sorted(lags.items())},
                      "mean": _r(sum(k * v for k, v in lags.items()) / n_lags) if n_lags else None,
                      "p50": _percentile(lags, 0.5), "p95": _percentile(lags, 0.95),
                      "max": max(lags, default=0)},
        "pushes": {"decided": sim.counts["pushes"], "accepted": sim.counts["accepted"],
                   "rejected": sim.counts["rejected"],
                   "rejected_frac": _r(sim.counts["rejected"] / sim.counts["pushes"])
                   if sim.counts["pushes"] else 0.0,
                   "rejected_by": dict(sorted(sim.reasons.items())),
                   "sent_ahead": sim.counts["sent_ahead"],
                   # requests not admitted within timeouts.admit_s, withdrawn and asked again
                   "admission": {"deadline_s": sc.leader.timeouts.admit_s,
                                 "withdrawn": sim.counts["withdrawn"],
                                 "pushes_withdrawn": sim.counts["pushes_withdrawn"],
                                 "tries_max": max(1, sim.counts["tries_max"])},
                   "refused": dict(sorted(sim.refusals.items()))},
        "tokens": {"accepted": sim.tokens_accepted, "budget": sc.token_budget,
                   "windows_short": sum(m.windows_short for m in sim.members.values()),
                   "ledger": sim.ledger.summary()},
    }
    doc["server_faults"] = {
        "outer_steps_lost": sim.counts["outer_steps_lost"],
        "leader_restarts": sim.counts["leader_restarts"], "rejoins": sim.counts["rejoins"],
        "random_follower_faults": sim.counts["random_follower_faults"],
        "random_leader_faults": sim.counts["random_leader_faults"],
        "events": [[_r(t), kind, detail] for t, kind, detail in sim.fault_log[:100]]}
    doc["horizon"] = horizon_answer(sim.version, {c: len(m.pull_s) for c, m in
                                                  sim.members.items()}, sc.horizon_s)
    doc["reference"] = _reference(sim, doc)
    return doc
