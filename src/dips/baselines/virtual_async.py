"""Naive decentralized asynchronous DiLoCo in virtual time (the failing baseline of §4).

No parameter server: each cluster i keeps its own copy θ_i of the global model and its own
replica of the Nesterov outer optimizer (lr 0.7, momentum 0.8).  When cluster i finishes H
inner steps at virtual time t it forms Δ_i = θ_i − θ_i,local (local model in BF16, as sent) and
sends Δ_i in BF16 to every peer point to point, one peer after the other over its own link
(each transfer at min(sender, receiver) bandwidth, :func:`dips.emu.vclock.transfer_s`).  When
its sends are done it applies, without waiting for anyone, the uniform mean of its own Δ_i and
every peer pseudo-gradient that has *arrived* since its last outer step, then restarts from the
new θ_i.  No penalty, no token weighting, no clipping: the pseudo-gradients of different
replicas are mixed as if they had the same base, which is what breaks convergence under
heterogeneity (§4).  Evaluations use cluster 0's θ_0.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dips.algo import nesterov_step, pseudo_gradient, weighted_mean
from dips.emu.result import MethodResult
from dips.emu.vclock import EventQueue, transfer_s
from dips.emu.vworld import World, bf16_copy, load_params
from dips.spec import Scenario

__all__ = ["run_async_diloco"]


def run_async_diloco(scenario: Scenario, out_dir: Path) -> MethodResult:
    """Naive decentralized async DiLoCo on ``scenario`` (see the module docstring).

    ``extra``: mean number of pseudo-gradients averaged per outer step, per-cluster outer steps.
    """
    s = scenario
    world = World(s, out_dir, "async-diloco")
    names = world.names
    n = len(world.clusters)
    theta = [[p.detach().clone() for _, p in c.model.named_parameters()] for c in world.clusters]
    momenta = [[torch.zeros_like(p) for p in th] for th in theta]
    inbox: list[list[list[torch.Tensor]]] = [[] for _ in range(n)]
    own: list[list[torch.Tensor] | None] = [None] * n
    sync_start = [0.0] * n
    applied = [0] * n
    mixed: list[int] = []
    pushed = 0
    q = EventQueue()
    for i, c in enumerate(world.clusters):
        q.push(world.step_s(c, 0.0), "step", i)
    world.maybe_eval(0.0, lambda: dict(zip(names, theta[0])))
    t = 0.0
    while len(q):
        t, kind, i = q.pop()
        if kind == "arrive":
            i, delta = i
            inbox[i].append(delta)
            continue
        c = world.clusters[i]
        if kind == "step":
            c.step()
            if world.done:
                break
            world.maybe_eval(t, lambda: dict(zip(names, theta[0])))
            if c.steps % s.inner.H:
                q.push(t + world.step_s(c, t), "step", i)
                continue
            local = bf16_copy(c.model)
            delta = [pseudo_gradient(p, local[nm]) for nm, p in zip(names, theta[i])]
            own[i] = delta
            wire = [d.to(torch.bfloat16) for d in delta]
            sync_start[i] = t
            tc = t
            for k in range(1, n):  # peers in ring order, one after the other
                j = (i + k) % n
                peer = world.clusters[j].spec
                tc += transfer_s(c.spec, tc, world.transfer_bytes, s.timing.latency_s,
                                 cap_bps=peer.link.rate_at(tc))
                q.push(tc, "arrive", (j, wire))  # arrivals sort before applies at equal times
            pushed += 1
            q.push(tc, "apply", i, priority=1)
        elif kind == "apply":
            deltas = [own[i]] + [[d.float() for d in got] for got in inbox[i]]
            inbox[i].clear()
            mixed.append(len(deltas))
            mean = weighted_mean(deltas, [1.0 / len(deltas)] * len(deltas))
            nesterov_step(theta[i], momenta[i], mean, s.outer.lr, s.outer.momentum)
            load_params(c.model, dict(zip(names, theta[i])))
            applied[i] += 1
            c.comm_s += t - sync_start[i]
            c.idle_s += t - sync_start[i]
            c.tokens_since_sync = 0
            world.log(cluster=c.spec.id, time=round(t, 6), outer_step=applied[i],
                      mixed=len(deltas), send_s=t - sync_start[i])
            q.push(t + world.step_s(c, t), "step", i)
    for i, c in enumerate(world.clusters):
        c.extra["outer_steps"] = applied[i]
    extra = {"mean_mixed": sum(mixed) / len(mixed) if mixed else 0.0,
             "outer_steps": sum(applied)}
    return world.result(t, world.tokens, pushed, pushed, 0, dict(zip(names, theta[0])), extra)
