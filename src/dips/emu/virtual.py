"""Di-PS in virtual time: the §6 outer loop driven by an event heap, with the real outer-step code.

All clusters train their real models in one process (see :mod:`dips.emu.vworld`); a virtual
clock (:mod:`dips.emu.vclock`) orders their inner steps and charges each transfer its emulated
size over its link.  The parameter server is the real code, in process: one
:class:`dips.roles.follower.FollowerShard` per follower (layers split by
:func:`dips.algo.partition_contiguous`, pushes staged through ``FollowerShard.handle`` exactly as
the data plane delivers them, BF16), and the leader's decisions from :mod:`dips.algo`
(``decide`` with the §8 penalty α 0.02 / β 3, ``token_weights``, ``clip_factor`` with max norm 1;
Nesterov lr 0.7, momentum 0.8 inside the followers).

The §6 round, in virtual time:

1. A cluster that finished H inner steps requests a push.  If no round is open, its request
   opens one: the grace window closes ``grace_window_s`` later; requests up to the close join.
   Each admitted cluster starts sending at once (push time = bytes / its bandwidth).
2. The push phase ends when the window is closed and every admitted push has arrived; the
   followers score, the leader decides, the followers aggregate and apply (``timing.update_s``).
3. Every cluster of the round (accepted or not) pulls the new version over its link and resumes.
   The round ends when the update is committed: the next window may open while the round's
   clusters still pull (a slow link delays only its own cluster; the followers serve each
   version until its pulls are done).  With the pull barrier of the seed's §6 round
   (``di-ps-pull-barrier``, ``LeaderConfig.pull_barrier``) it ends when the last pull is done.
   Requests during push/update (and the barrier's pulls) wait for the next round, which opens
   when this one ends.

Ablations (§15): ``di-ps-no-penalty`` (penalty off), ``di-ps-uniform`` (1/n weights),
``di-ps-no-clip`` (max_norm None), ``di-ps-no-grace`` (window 0), ``di-ps-pull-barrier`` (the
seed's round: no new window until every pull is done).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from dips.algo import PenaltyConfig, PenaltyState, clip_factor, decide, partition_contiguous, token_weights
from dips.bench.result import MethodResult
from dips.bench.runners import register
from dips.bench.scenario import Scenario
from dips.emu.vclock import EventQueue, transfer_s
from dips.emu.vworld import World, bf16_copy, load_params
from dips.roles.follower import FollowerShard
from dips.wire.frames import Message

__all__ = ["InProcessPS", "run_dips"]

VARIANTS = ("di-ps", "di-ps-no-penalty", "di-ps-uniform", "di-ps-no-clip", "di-ps-no-grace",
            "di-ps-pull-barrier")


class InProcessPS:
    """Leader decisions + follower shards of §5/§6/§8, called directly instead of over gRPC/ZeroMQ.

    Args:
        world: supplies the layer table and the initial FP32 parameters (cluster 0's model).
        followers: number of follower shards.
        penalty: §8 settings; uniform: 1/n weights; max_norm: global clip (None: off).
        outer_lr, outer_momentum: Nesterov settings of the followers.
    """

    def __init__(self, world: World, followers: int, penalty: PenaltyConfig, uniform: bool,
                 max_norm: float | None, outer_lr: float, outer_momentum: float) -> None:
        parts = partition_contiguous([nbytes for _, _, nbytes in world.table], followers)
        init = {n: p.detach().clone() for n, p in world.clusters[0].model.named_parameters()}
        self.shards = [FollowerShard(i, {world.table[k][0]: world.table[k][1] for k in r}, init,
                                     outer_lr=outer_lr, outer_momentum=outer_momentum)
                       for i, r in enumerate(parts)]
        self.penalty_cfg, self.penalty = penalty, PenaltyState()
        self.uniform, self.max_norm = uniform, max_norm
        self.version = 0

    def stage(self, rnd: int, cluster: str, params: dict[str, torch.Tensor]) -> None:
        """Deliver one cluster's BF16 layers to the owning followers (the data-plane push)."""
        for shard in self.shards:
            for layer, names in shard.layers.items():
                shard.handle(Message({"op": "push", "cluster": cluster, "round": rnd, "layer": layer},
                                     {n: params[n] for n in names}))

    def outer_step(self, rnd: int, tokens: dict[str, int]) -> dict:
        """Score, decide, aggregate, clip and apply round ``rnd`` (as ``Leader._outer_step``).

        ``tokens``: cluster -> T_j of its push. Returns the round record (accepted, rejected,
        scores, weights, clip factor, version).
        """
        members = sorted(tokens)
        norms = {c: 0.0 for c in members}
        for shard in self.shards:
            for c, valid, sq, err in shard.score(rnd, members):
                if not valid:
                    raise RuntimeError(f"follower {shard.index} refused {c}: {err}")
                norms[c] += sq
        verdict, self.penalty = decide(self.penalty, norms, self.penalty_cfg)
        accepted = verdict.accepted
        weights, clip = {}, None
        if accepted:
            weights = token_weights({c: tokens[c] for c in accepted}, accepted, uniform=self.uniform)
            w = [weights[c] for c in accepted]
            sq_norm = sum(s.aggregate(rnd, accepted, w) for s in self.shards)
            clip = clip_factor(sq_norm, self.max_norm if self.max_norm else float("inf"))
            for s in self.shards:
                s.apply(rnd, clip, self.version + 1, accepted, w)
            for s in self.shards:  # two-phase followers (prepare, then commit) when available
                if hasattr(s, "commit"):
                    s.commit(self.version + 1)
            self.version += 1
        else:
            for s in self.shards:
                s.discard(rnd)
        return {"round": rnd, "version": self.version, "clusters": members, "accepted": accepted,
                "rejected": verdict.rejected, "scores": verdict.scores, "sq_norms": norms,
                "weights": weights, "clip_factor": clip, "tokens": dict(tokens)}

    def pull(self) -> dict[str, torch.Tensor]:
        """The current version in BF16, through each follower's pull handler."""
        out: dict[str, torch.Tensor] = {}
        for s in self.shards:
            _, tensors = s.handle(Message({"op": "pull", "version": self.version,
                                           "layers": list(s.layers), "dtype": "bf16"}))
            out.update(dict(tensors))
        return out

    def global_params(self) -> dict[str, torch.Tensor]:
        """The FP32 global θ (all shards), for evaluation."""
        return {n: p for s in self.shards for n, p in s.params.items()}


@dataclass
class _Round:
    number: int
    close_t: float
    members: dict[str, dict] = field(default_factory=dict)  # cluster -> push record
    open_t: float = 0.0


def run_dips(scenario: Scenario, out_dir: Path, method: str = "di-ps") -> MethodResult:
    """Run Di-PS (or an ablation in :data:`VARIANTS`) on ``scenario`` in virtual time.

    Returns the :class:`MethodResult`; ``extra`` holds per-cluster idle/comm seconds, mean
    staleness (version lag at push, outer versions) and the number of rounds.
    Raises ValueError for an unknown variant.
    """
    if method not in VARIANTS:
        raise ValueError(f"method = {method!r} is not a Di-PS variant {VARIANTS}")
    s = scenario
    world = World(s, out_dir, method)
    pcfg = PenaltyConfig(alpha=s.penalty.alpha, beta=s.penalty.beta, warmup=s.penalty.warmup,
                         enabled=s.penalty.enabled and method != "di-ps-no-penalty")
    ps = InProcessPS(world, s.followers, pcfg, s.outer.uniform_weights or method == "di-ps-uniform",
                     None if method == "di-ps-no-clip" else s.outer.max_norm, s.outer.lr,
                     s.outer.momentum)
    grace = 0.0 if method == "di-ps-no-grace" else s.grace_window_s
    pull_barrier = method == "di-ps-pull-barrier"
    lat, nbytes, H = s.timing.latency_s, world.transfer_bytes, s.inner.H
    by_id = {c.spec.id: c for c in world.clusters}
    base_version = {cid: 0 for cid in by_id}
    requested_at: dict[str, float] = {}
    queue: list[str] = []
    rnd: _Round | None = None
    phase = "idle"
    rounds = pushed = accepted_n = rejected_n = tokens_accepted = 0
    lags: list[int] = []
    lags_by: dict[str, list[int]] = {}
    q = EventQueue()
    for c in world.clusters:
        q.push(world.step_s(c, 0.0), "step", c.spec.id)
    world.maybe_eval(0.0, ps.global_params)

    def admit(cid: str, t: float) -> None:
        c = by_id[cid]
        ps.stage(rnd.number, cid, bf16_copy(c.model))
        dur = transfer_s(c.spec, t, nbytes, lat)
        c.comm_s += dur
        lag = ps.version - base_version[cid]
        lags.append(lag)
        lags_by.setdefault(cid, []).append(lag)
        rnd.members[cid] = {"tokens": c.tokens_since_sync, "push_end": t + dur, "lag": lag,
                            "push_s": dur}

    def open_round(t: float) -> None:
        nonlocal rnd, phase, rounds
        rounds += 1
        rnd = _Round(rounds, t + grace, open_t=t)
        phase = "window"
        q.push(rnd.close_t, "close", rounds, priority=1)  # joins at exactly close_t come first

    t = 0.0
    while len(q):
        t, kind, payload = q.pop()
        if kind == "step":
            c = by_id[payload]
            c.step()
            if world.done:
                break
            world.maybe_eval(t, ps.global_params)
            if c.steps % H:
                q.push(t + world.step_s(c, t), "step", payload)
                continue
            requested_at[payload] = t
            if phase == "idle":
                open_round(t)
            if phase == "window":
                admit(payload, t)
            else:
                queue.append(payload)
        elif kind == "close":
            phase = "push"
            end = max([rnd.close_t] + [m["push_end"] for m in rnd.members.values()])
            q.push(end, "update", rnd.number)
        elif kind == "update":
            rec = ps.outer_step(rnd.number, {c: m["tokens"] for c, m in rnd.members.items()})
            pushed += len(rnd.members)
            accepted_n += len(rec["accepted"])
            rejected_n += len(rnd.members) - len(rec["accepted"])
            tokens_accepted += sum(rnd.members[c]["tokens"] for c in rec["accepted"])
            theta, start = ps.pull(), t + s.timing.update_s
            ends = []
            for cid in sorted(rnd.members):
                c = by_id[cid]
                dur = transfer_s(c.spec, start, nbytes, lat)
                c.comm_s += dur
                ends.append(start + dur)
                q.push(start + dur, "pulled", (cid, theta, ps.version))
            q.push(max(ends) if pull_barrier else start, "round_end", rnd.number, priority=2)
            world.log(**rec, time=round(t, 6), window_open=rnd.open_t, window_close=rnd.close_t,
                      lags={c: m["lag"] for c, m in rnd.members.items()},
                      push_s={c: m["push_s"] for c, m in rnd.members.items()})
        elif kind == "pulled":
            cid, theta, version = payload
            c = by_id[cid]
            load_params(c.model, theta)
            base_version[cid] = version
            c.tokens_since_sync = 0
            c.idle_s += t - requested_at.pop(cid)
            q.push(t + world.step_s(c, t), "step", cid)
        elif kind == "round_end":
            phase, rnd = "idle", None
            if queue:
                open_round(t)
                for cid in queue:
                    admit(cid, t)
                queue.clear()
    for cid, t_req in requested_at.items():  # clusters waiting when the budget ran out
        by_id[cid].idle_s += t - t_req
    for c in world.clusters:
        mine = lags_by.get(c.spec.id, [])
        c.extra["pushes"] = len(mine)
        c.extra["mean_staleness"] = round(sum(mine) / len(mine), 4) if mine else None
    extra = {"rounds": rounds, "outer_steps": ps.version,
             "mean_staleness": sum(lags) / len(lags) if lags else 0.0,
             "max_staleness": max(lags, default=0), "grace_window_s": grace}
    return world.result(t, tokens_accepted, pushed, accepted_n, rejected_n, ps.global_params(), extra)


def _register() -> None:
    for variant in VARIANTS:
        register("virtual", variant)(lambda sc, out, _v=variant: run_dips(sc, out, _v))


_register()
