"""Calibration of ``dips simulate`` against the virtual-time engine (issue 16; seed §13).

:func:`from_scenario` maps a comparison :class:`dips.spec.Scenario` (what ``dips bench compare``
runs in virtual time, :mod:`dips.emu.virtual`) to a :class:`dips.spec.simulate.SimScenario`
charging exactly the costs the virtual engine charges:

* an inner step lasts ``timing.step_s`` × the cluster's §13 slowdown (its transients too), the
  same :func:`dips.emu.vclock.step_duration`; ``inner.batch_size`` windows of ``inner.seq_len``
  tokens per step, H = ``inner.H``;
* a push or a pull moves ``2 × params × timing.model_bytes_scale`` bytes (BF16; FP32 doubles
  it) over the cluster's link (its schedule too): one stage worker, links as stated, the
  followers' NICs unbounded (the virtual engine has no server-side limit) and
  ``wire_bytes_scale = model_bytes_scale``; ``timing.latency_s`` is charged per transfer in the
  simulation (per layer pushed, per follower pulled) but once per push / pull in virtual time,
  so a scenario with latency maps only approximately (the shipped ones have none);
* the update phase lasts ``timing.update_s``: the largest shard's parameters × a cost per
  parameter equal to it, no RPC latency;
* no timeouts, no faults, no heartbeats cost; clusters start from the initial model without a
  pull (``initial_pull: false``), as virtual clusters do;
* the grace window, penalty and outer settings of the method (:func:`variant_settings`).

What is not mapped: the pseudo-gradients. The virtual engine trains real models and its §8
penalty scores their real ‖Δ‖²; the simulation draws them from :class:`NormModel`. Rejections
(and so the tokens accepted per round) can differ; the figures compared are time to the token
budget, outer steps and per-cluster idle fraction (:func:`figures`, :func:`ratios`).
"""

from __future__ import annotations

import math
from typing import Any

from dips.algo.partition import partition_contiguous
from dips.sim.costs import layer_params
from dips.spec import Scenario
from dips.spec.scenario import variant_settings
from dips.spec.simulate import SimScenario

__all__ = ["UNBOUNDED_NIC_BPS", "figures", "from_scenario", "ratios", "virtual_figures"]

#: A follower NIC no flow ever reaches (bits/s): the virtual engine charges only cluster links.
UNBOUNDED_NIC_BPS = 1e18


def from_scenario(s: Scenario, method: str = "di-ps", seed: int | None = None) -> SimScenario:
    """The simulation of Di-PS ``method`` on virtual-time scenario ``s`` (module docstring).

    ``seed``: of the ‖Δ‖² draws (default ``s.seed``). Raises ValueError for a method that is
    not a Di-PS variant, pydantic's error (naming the field) if the result is invalid.
    """
    grace, penalty, outer = variant_settings(s, method)
    sizes = [p for _, p in layer_params(s.model)]
    shards = partition_contiguous([4 * p for p in sizes], s.followers)
    largest = max(sum(sizes[k] for k in r) for r in shards)
    n = len(s.clusters)
    tokens_per_push = s.inner.H * s.inner.batch_size * s.inner.seq_len
    windows_per_chunk = s.inner.H * s.inner.batch_size  # one push per chunk
    # Data never runs out: twice the budget in pushes, plus what every cluster may hold.
    chunks = 2 * math.ceil(s.token_budget / tokens_per_push) + 4 * n
    slowest = max(c.slowdown for c in s.clusters) * max(
        (f.factor for c in s.clusters for f in c.transient), default=1.0)
    horizon = 100.0 * s.token_budget / (s.inner.batch_size * s.inner.seq_len) \
        * s.timing.step_s * slowest + 3600.0
    inf = float("inf")
    clusters = [{"id": c.id, "stages": 1, "step_s": s.timing.step_s, "slowdown": c.slowdown,
                 "transient": [t.model_dump() for t in c.transient],
                 "windows_per_step": s.inner.batch_size,
                 "uplink": c.link.model_dump(), "latency_s": s.timing.latency_s,
                 "initial_pull": False} for c in s.clusters]
    doc: dict[str, Any] = {
        "name": f"{s.name}-{method}-calibration", "seed": s.seed if seed is None else seed,
        "model": s.model.model_dump(), "H": s.inner.H, "wire_bytes_scale": s.timing.model_bytes_scale,
        "outer": outer.model_dump(), "penalty": penalty.model_dump(),
        "leader": {"grace": grace.model_dump(),
                   "timeouts": {"push_s": inf, "pull_s": inf, "push_slack": inf},
                   "rpc_cpu_s": 0.0, "rpc_latency_s": 0.0},
        "followers": {"count": s.followers, "nic_bps": UNBOUNDED_NIC_BPS,
                      "update_s_per_param": s.timing.update_s / largest},
        "clusters": clusters,
        "data": {"tokens_per_window": s.inner.seq_len, "num_chunks": chunks,
                 "windows_per_chunk": windows_per_chunk},
        "horizon_s": horizon, "token_budget": s.token_budget}
    return SimScenario.model_validate(doc)


def figures(doc: dict[str, Any]) -> dict[str, Any]:
    """The compared figures of a ``simulate.json`` document: ``time_s`` (seconds to the token
    budget), ``outer_steps``, ``idle_frac`` per cluster (time from push request to pull done /
    run seconds), and for information pushes, rejections, mean staleness."""
    return {"time_s": doc["simulated_s"], "outer_steps": doc["rounds"]["outer_steps"],
            "idle_frac": {c: v["idle_frac"] for c, v in doc["clusters"].items()},
            "pushes": doc["pushes"]["decided"], "rejected": doc["pushes"]["rejected"],
            "mean_staleness": doc["staleness"]["mean"], "finished": doc["finished"]}


def virtual_figures(result: Any) -> dict[str, Any]:
    """The same figures of a virtual-time :class:`dips.emu.result.MethodResult`."""
    ex = result.extra
    return {"time_s": result.time_s, "outer_steps": ex["outer_steps"],
            "idle_frac": {c: v["idle_frac"] for c, v in ex["clusters"].items()},
            "pushes": result.updates_pushed, "rejected": result.updates_rejected,
            "mean_staleness": ex["mean_staleness"], "finished": "token_budget"}


def ratios(sim: dict[str, Any], virtual: dict[str, Any]) -> dict[str, float]:
    """Simulated / virtual for time to budget, outer steps and each cluster's idle fraction
    (``idle_frac.<cluster>``); dimensionless, 1.0 = equal."""
    out = {"time_s": sim["time_s"] / virtual["time_s"],
           "outer_steps": sim["outer_steps"] / virtual["outer_steps"]}
    for c, v in virtual["idle_frac"].items():
        out[f"idle_frac.{c}"] = sim["idle_frac"][c] / v if v else math.inf
    return out
