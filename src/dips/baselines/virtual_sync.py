"""Synchronous baselines in virtual time: cross-cluster data parallel and synchronous DiLoCo (§3, §4).

Both run the real model, data chunks and inner AdamW of :mod:`dips.emu.vworld`; the virtual
clock charges compute and ring all-reduce times (:mod:`dips.emu.vclock`).

* **Data parallel** (``dp``): every inner step each cluster computes the gradient of its own
  batch, the gradients are all-reduced (mean) and one AdamW step is applied to the replicated
  model.  The replicas stay bit-identical, so one model holds them.  A step lasts as long as
  the slowest cluster's compute, then the all-reduce of the BF16 gradient (model-sized) over
  the slowest link: the WAN sits on the critical path of every step (§4).
* **Synchronous DiLoCo** (``diloco``): every H inner steps a barrier, then a ring all-reduce of
  the pseudo-gradients Δ_i = θ − θ_i (BF16, or FP32 with ``outer.wire_dtype``), their uniform
  mean, and the same Nesterov outer step (lr 0.7, momentum 0.8, no clipping, FP32) applied by
  every cluster's replica of the outer optimizer (§3).  Each round lasts as long as the slowest cluster plus the slowest link.

Runs stop at the end of the step/round that reaches the token budget.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dips.algo import nesterov_step, pseudo_gradient, weighted_mean
from dips.emu.result import MethodResult
from dips.emu.vclock import ring_allreduce_s
from dips.emu.vworld import World, load_params, wire_copy
from dips.spec import Scenario

__all__ = ["run_diloco", "run_dp"]


def run_dp(scenario: Scenario, out_dir: Path) -> MethodResult:
    """Cross-cluster data parallel in virtual time (see the module docstring).

    Raises FloatingPointError on a non-finite loss.
    """
    s = scenario
    world = World(s, out_dir, "dp", replicas=False)
    shared = world.clusters[0].trainer  # every cluster's trainer holds this model and AdamW
    model = shared.model
    specs = [c.spec for c in world.clusters]
    n = len(world.clusters)
    t = 0.0
    world.maybe_eval(0.0, lambda: model)
    while not world.done:
        durations = [world.step_s(c, t) for c in world.clusters]
        compute_end = t + max(durations)
        # One inner step of the replicated model: each cluster's batch adds its gradient ÷ n
        # (in cluster order: the sum's rounding is part of the result), then one clip + AdamW.
        shared.zero_grad()
        total = 0.0
        for c in world.clusters:
            total += c.trainer.accumulate(divide_by=n)
        shared.apply()
        ar = ring_allreduce_s(specs, compute_end, world.transfer_bytes, s.timing.latency_s)
        for c, d in zip(world.clusters, durations):
            c.comm_s += ar
            c.idle_s += (max(durations) - d) + ar
            c.last_loss = total
        t = compute_end + ar
        world.maybe_eval(t, lambda: model)
    return world.result(t, world.tokens, 0, 0, 0, model, {"allreduce_per_step_s": ar if n > 1 else 0.0})


def run_diloco(scenario: Scenario, out_dir: Path) -> MethodResult:
    """Synchronous DiLoCo in virtual time (see the module docstring)."""
    s = scenario
    world = World(s, out_dir, "diloco")
    specs = [c.spec for c in world.clusters]
    n = len(world.clusters)
    names = world.names
    theta = [p.detach().clone() for _, p in world.clusters[0].model.named_parameters()]
    momenta = [torch.zeros_like(p) for p in theta]
    t = 0.0
    rounds = pushed = 0
    world.maybe_eval(0.0, lambda: dict(zip(names, theta)))
    while not world.done:
        ends = []
        for c in world.clusters:
            tc = t
            for _ in range(s.inner.H):
                tc += world.step_s(c, tc)
                c.step()
            ends.append(tc)
        barrier = max(ends)
        ar = ring_allreduce_s(specs, barrier, world.wire_bytes, s.timing.latency_s)
        deltas = []
        for c in world.clusters:
            local = wire_copy(c.model, s.outer.wire_dtype)
            deltas.append([pseudo_gradient(p, local[name]) for name, p in zip(names, theta)])
        mean = weighted_mean(deltas, [1.0 / n] * n)
        nesterov_step(theta, momenta, mean, s.outer.lr, s.outer.momentum)
        for c, end in zip(world.clusters, ends):
            load_params(c.model, dict(zip(names, theta)))
            c.comm_s += ar
            c.idle_s += (barrier - end) + ar
            c.tokens_since_sync = 0
        rounds += 1
        pushed += n
        t = barrier + ar
        world.log(round=rounds, time=round(t, 6), barrier_wait_s={c.spec.id: barrier - e for c, e
                                                                 in zip(world.clusters, ends)},
                  allreduce_s=ar)
        world.maybe_eval(t, lambda: dict(zip(names, theta)))
    return world.result(t, world.tokens, pushed, pushed, 0, dict(zip(names, theta)),
                        {"rounds": rounds, "outer_steps": rounds})
