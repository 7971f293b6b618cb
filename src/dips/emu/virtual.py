"""Di-PS in virtual time: the leader's own round machine and outer step, driven by an event heap.

All clusters train their real models in one process (see :mod:`dips.emu.vworld`); a virtual
clock (:mod:`dips.emu.vclock`) orders their inner steps and charges each transfer its emulated
size over its link.  The parameter server is the real code, in process: one
:class:`dips.roles.follower.FollowerShard` per follower (layers split by
:func:`dips.algo.partition_contiguous`, pushes staged through ``FollowerShard.handle`` exactly as
the data plane delivers them, in the wire dtype: BF16, or FP32 with ``outer.wire_dtype``,
which also doubles each transfer's bytes).  Every decision is the real leader's: the round
machine of :mod:`dips.algo.round` (grace window, fixed or the dynamic τ* of §7; push and pull phases; the
pull barrier; verdicts) fed with virtual time, and the update phase of
:func:`dips.roles.outer_step.run_update` (§8 penalty, token weights, one clip factor, the
two-phase Nesterov step on every follower).  Nothing of the round is re-implemented here.

The §6 round, in virtual time:

1. A cluster that finished H inner steps requests a push (:class:`~dips.algo.round.PushRequested`).
   When the machine admits it, its stage workers start sending at once (push time = bytes /
   its bandwidth); the machine's window closes at a :class:`~dips.algo.round.Tick` at its
   close time.
2. Each push's arrival is a :class:`~dips.algo.round.PushReported`; when the window is closed
   and every push arrived, the machine starts the update, which takes ``timing.update_s``.
3. At the verdicts every cluster of the round pulls the new version over its link and resumes;
   without the pull barrier the next window may open at once (a slow link delays only its own
   cluster), with it (``di-ps-pull-barrier`` or ``grace.pull_barrier``) the round ends at the
   last pull.

The run ends as the real leader ends one (:func:`dips.algo.limits.stop_reason`): at the update
that brings the accepted tokens to the budget, so the final model holds at least the budget,
as synchronous DiLoCo's does at the end of its last round (work still in flight is not merged).

Ablations (§15): ``di-ps-no-penalty`` (penalty off), ``di-ps-uniform`` (1/n weights),
``di-ps-no-clip`` (clip seed, max_norm None), ``di-ps-no-grace`` (window 0),
``di-ps-pull-barrier`` (the seed's round: no new window until every pull is done),
``di-ps-dynamic-grace`` (§7's τ*).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import torch

from dips.algo import grace as grace_rules
from dips.algo import partition_contiguous
from dips.algo.limits import stop_reason
from dips.algo.penalty import PenaltyState
from dips.algo.round import (Admitted, Decided, PullDone, PushReported, PushRequested,
                             RoundEnded, RoundOpened, RoundPolicy, RoundState, Staged, StartUpdate,
                             Tick, UpdateFinished, step)
from dips.emu.result import MethodResult
from dips.emu.vclock import EventQueue, transfer_s
from dips.emu.vworld import World, load_params, wire_copy
from dips.roles.follower import FollowerShard
from dips.roles.outer_step import run_update
from dips.spec import OuterConfig, Scenario
from dips.spec.scenario import METHODS, variant_settings
from dips.wire.frames import Message

__all__ = ["InProcessPS", "VARIANTS", "run_dips"]

VARIANTS = tuple(m for m in METHODS if m.startswith("di-ps"))


class InProcessPS:
    """The follower shards of §5/§6, called directly instead of over gRPC/ZeroMQ.

    Args:
        world: supplies the layer table and the initial FP32 parameters (cluster 0's model).
        followers: number of follower shards.
        outer: the followers' Nesterov settings, state precision and the wire dtype
            (:class:`dips.spec.OuterConfig`).
    """

    def __init__(self, world: World, followers: int, outer: OuterConfig) -> None:
        parts = partition_contiguous([nbytes for _, _, nbytes in world.table], followers)
        init = {n: p.detach().clone() for n, p in world.clusters[0].model.named_parameters()}
        self.shards = [FollowerShard(i, {world.table[k][0]: world.table[k][1] for k in r}, init,
                                     outer_lr=outer.lr, outer_momentum=outer.momentum,
                                     state_dtype=outer.state_dtype)
                       for i, r in enumerate(parts)]
        self.penalty = PenaltyState()
        self.version = 0
        self.wire_dtype = outer.wire_dtype

    @property
    def followers(self) -> list[tuple[int, FollowerShard]]:
        """``(index, control)`` of every follower, as :func:`run_update` takes them."""
        return [(s.index, s) for s in self.shards]

    def stage(self, rnd: int, cluster: str, params: dict[str, torch.Tensor],
              ahead_of: str | None = None) -> None:
        """Deliver one cluster's layers (wire dtype) to the owning followers (a data-plane push);
        ``ahead_of``: the push id of a push sent ahead of its round (kept until scored)."""
        extra = {"stage": True, "push_id": ahead_of} if ahead_of is not None else {}
        for shard in self.shards:
            for layer, names in shard.layers.items():
                shard.handle(Message({"op": "push", "cluster": cluster, "round": rnd,
                                      "layer": layer, **extra}, {n: params[n] for n in names}))

    def pull(self) -> dict[str, torch.Tensor]:
        """The current version in the wire dtype, through each follower's pull handler."""
        out: dict[str, torch.Tensor] = {}
        for s in self.shards:
            _, tensors = s.handle(Message({"op": "pull", "version": self.version,
                                           "layers": list(s.layers), "dtype": self.wire_dtype}))
            out.update(dict(tensors))
        return out

    def global_params(self) -> dict[str, torch.Tensor]:
        """The FP32 global θ (all shards), for evaluation."""
        return {n: p for s in self.shards for n, p in s.params.items()}




def run_dips(scenario: Scenario, out_dir: Path, method: str = "di-ps") -> MethodResult:
    """Run Di-PS (or an ablation in :data:`VARIANTS`) on ``scenario`` in virtual time.

    Returns the :class:`MethodResult`; ``extra`` holds per-cluster idle/comm seconds, mean
    staleness (version lag at push, outer versions) and the number of rounds.
    Raises ValueError for a method that is not a Di-PS variant.
    """
    s = scenario
    grace, pcfg, outer = variant_settings(s, method)
    world = World(s, out_dir, method)
    ps = InProcessPS(world, s.followers, outer)
    # Pushes and pulls in virtual time always arrive: no timeouts, no push deadlines.
    policy = RoundPolicy(grace, push_timeout_s=math.inf, pull_timeout_s=math.inf,
                         push_slack=math.inf)
    lat, nbytes, H = s.timing.latency_s, world.wire_bytes, s.inner.H
    by_id = {c.spec.id: c for c in world.clusters}
    base_version = {cid: 0 for cid in by_id}
    requested_at: dict[str, float] = {}
    push_ids: dict[str, str] = {}
    last_push_s: dict[str, float] = {}  # each cluster's last measured push, emulated seconds
    ahead: dict[str, int] = {}  # clusters whose push travels ahead of any round -> staleness
    rounds: dict[int, dict[str, Any]] = {}  # round -> what its log line needs
    new_versions: dict[int, tuple[dict[str, torch.Tensor], int]] = {}  # round -> (θ pulled, version)
    counts = {"pushed": 0, "accepted": 0, "rejected": 0, "tokens_accepted": 0}
    lags: list[int] = []
    lags_by: dict[str, list[int]] = {}
    state = RoundState()
    q = EventQueue()
    for c in world.clusters:
        q.push(world.step_s(c, 0.0), "step", c.spec.id)
    world.maybe_eval(0.0, ps.global_params)

    def feed(event: Any) -> None:
        """The leader: one event into the round machine, its actions carried out."""
        nonlocal state
        state, actions = step(state, event, policy)
        for a in actions:
            if isinstance(a, RoundOpened):
                rounds[a.number] = {"window_open": a.opened_at, "window_close": a.closes_at,
                                    "grace": grace_rules.stats(state.grace, policy.grace),
                                    "lags": {}, "push_s": {}}
                q.push(a.closes_at, "tick", None, priority=1)  # joins at close_t come first
            elif isinstance(a, Admitted):
                if a.slot.done:  # sent ahead: it has arrived already
                    rounds[a.slot.round]["lags"][a.slot.cluster_id] = ahead.pop(a.slot.cluster_id)
                else:
                    admit(a.slot.cluster_id, a.slot.round, event.now)
            elif isinstance(a, Staged):
                admit(a.slot.cluster_id, None, event.now, a.slot.push_id)
            elif isinstance(a, StartUpdate):
                update(a, event.now)
            elif isinstance(a, Decided):
                pulls(a, event.now)
            elif isinstance(a, RoundEnded):
                rec = rounds.pop(a.number)
                world.log(**rec, window_s=a.window_s, push_phase_s=a.push_s,
                          update_s=a.update_s, pull_s=a.pull_s, grace_end=dict(a.grace))

    def admit(cid: str, number: int | None, t: float, ahead_of: str | None = None) -> None:
        """Start cluster ``cid``'s push at ``t``: into round ``number``, or ahead of any round
        (``ahead_of``: its push id)."""
        c = by_id[cid]
        ps.stage(number or 0, cid, wire_copy(c.model, outer.wire_dtype), ahead_of)
        dur = transfer_s(c.spec, t, nbytes, lat)
        c.comm_s += dur
        last_push_s[cid] = dur  # what the cluster predicts its next push from
        lag = ps.version - base_version[cid]
        lags.append(lag)
        lags_by.setdefault(cid, []).append(lag)
        if number is None:
            ahead[cid] = lag
        else:
            rounds[number]["lags"][cid] = lag
            rounds[number]["push_s"][cid] = dur
        q.push(t + dur, "pushed", cid)

    def update(start: StartUpdate, t: float) -> None:
        report = run_update(ps.followers, start.number, start.slots, ps.version, ps.penalty,
                            pcfg, outer, members=len(by_id))
        ps.version, ps.penalty = report.outcome.version, report.penalty
        accepted = report.outcome.accepted
        counts["pushed"] += len(start.slots)
        counts["accepted"] += len(accepted)
        counts["rejected"] += len(start.slots) - len(accepted)
        counts["tokens_accepted"] += sum(report.tokens[c] for c in accepted)
        rounds[start.number].update(report.record(start.number), time=round(t, 6))
        q.push(t + s.timing.update_s, "updated", (start.number, report.outcome, ps.pull(),
                                                  ps.version), priority=2)

    def pulls(decided: Decided, t: float) -> None:
        theta, version = new_versions.pop(decided.number)
        for v in decided.verdicts:
            c = by_id[v.cluster_id]
            dur = transfer_s(c.spec, t, nbytes, lat)
            c.comm_s += dur
            q.push(t + dur, "pulled", (v.cluster_id, theta, version))

    t = 0.0
    while len(q):
        t, kind, payload = q.pop()
        if kind == "step":
            c = by_id[payload]
            c.step()
            if world.tokens >= 2 * s.token_budget:
                break  # the accepted tokens cannot reach the budget (e.g. every push rejected)
            world.maybe_eval(t, ps.global_params)
            if c.steps % H:
                q.push(t + world.step_s(c, t), "step", payload)
                continue
            requested_at[payload] = t
            # A push id as the real leader's (16 hex digits), but deterministic: reruns stay
            # bit-identical.
            push_ids[payload] = hashlib.blake2b(f"{payload}-{c.steps}".encode(),
                                                digest_size=8).hexdigest()
            feed(PushRequested(t, payload, push_ids[payload], base_version[payload],
                               c.tokens_since_sync, last_push_s.get(payload)))
        elif kind == "tick":
            feed(Tick(t))
        elif kind == "pushed":
            feed(PushReported(t, payload, push_ids[payload], True))
        elif kind == "updated":
            number, outcome, theta, version = payload
            new_versions[number] = (theta, version)
            feed(UpdateFinished(t, number, outcome))
            # The run ends as the real leader ends it: once the accepted tokens reach the
            # budget, so the final model holds the budget (work still in flight is not merged).
            if stop_reason(tokens_accepted=counts["tokens_accepted"], outer_steps=ps.version,
                           training_s=None, token_budget=s.token_budget) is not None:
                break
        elif kind == "pulled":
            cid, theta, version = payload
            c = by_id[cid]
            load_params(c.model, theta)
            base_version[cid] = version
            c.tokens_since_sync = 0
            c.idle_s += t - requested_at.pop(cid)
            q.push(t + world.step_s(c, t), "step", cid)
            feed(PullDone(t, cid))
    for cid, t_req in requested_at.items():  # clusters waiting when the budget ran out
        by_id[cid].idle_s += t - t_req
    for c in world.clusters:
        mine = lags_by.get(c.spec.id, [])
        c.extra["pushes"] = len(mine)
        c.extra["mean_staleness"] = round(sum(mine) / len(mine), 4) if mine else None
    extra = {"rounds": state.rounds, "outer_steps": ps.version,
             "mean_staleness": sum(lags) / len(lags) if lags else 0.0,
             "max_staleness": max(lags, default=0), "grace_window_s": policy.grace.window_s,
             "grace_mode": policy.grace.mode}
    return world.result(t, counts["tokens_accepted"], counts["pushed"], counts["accepted"],
                        counts["rejected"], ps.global_params(), extra)

