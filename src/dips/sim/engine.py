"""The discrete-event simulation of a whole run: the real leader's decisions, modelled costs.

What decides is the leader's own code, fed with simulated time: the round machine
(:func:`dips.algo.round.step`: grace window of §7, push / update / pull phases, push deadlines,
pushes sent ahead, verdicts; ticks at :func:`dips.algo.round.next_deadline`), the update phase
(:func:`dips.roles.outer_step.run_update`: the §8 penalty :func:`dips.algo.penalty.decide`,
token weights, robust scale, clip, staleness scale), the §10 schedule
(:class:`dips.algo.schedule.ScheduleBook`), the layer ownership and the stage split
(:func:`dips.algo.partition.partition_contiguous`), the data-chunk ledger
(:class:`dips.algo.ledger.ChunkLedger`, :func:`dips.algo.limits.lease_allowed`) and the stop
rule (:func:`dips.algo.limits.stop_reason`). Nothing of them is re-implemented here. The round
machine and the update phase are looked up on their modules at each call (``round_machine.step``,
``outer_step.run_update``, which calls ``outer_step.decide``), so a test can wrap them.

What is modelled (:mod:`dips.sim.costs`, :mod:`dips.sim.network`): the seconds of H inner steps
(§13 slowdown), the transfers (per-stage links sharing follower NICs), the followers' outer
step (seconds per parameter), ‖Δ‖² (a documented stochastic model), faults (exponential MTBF
per cluster, and scheduled faults at a cluster's n-th push in one phase, :mod:`dips.sim.rounds`;
a failed cluster is removed after ``missed_heartbeats`` intervals as the real leader removes
it, rejoins after its recovery, pulls the whole model and trains on; the work since its last
pull is lost), follower and leader faults scheduled in a round's phase (:mod:`dips.sim.faults`:
readiness, reconciliation, rollback, the leader's resume) and the control messages the leader
handles. The ledger is settled where the
leader settles it: a push's progress reported once the machine took its request, a decided
step's verdicts at the decision (inside ``run_update``), a join releasing what the cluster held.

A cluster's life: join → pull the model → compute H steps → request a push (waits to be
admitted) → push (its stage workers send as the schedule says) → wait for the verdict → pull
the version named in the verdict (accepted or not) → compute again. Time spent from the
request to the end of the pull is the PS's overhead on that cluster.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from dips.algo.hold import BACKOFF_FIRST_S
from dips.algo.ledger import ChunkLedger
from dips.algo.limits import lease_allowed, stop_reason
from dips.algo.partition import partition_contiguous
from dips.algo.penalty import PenaltyState
from dips.algo.refusal import Refused
from dips.algo import round as round_machine
from dips.algo.round import (Admitted, Decided, MemberGone, PushReported,
                             RoundEnded, RoundOpened, RoundPolicy, RoundState,
                             Staged, StartUpdate, Tick, UpdateFinished, WindowClosed)
from dips.algo.schedule import ScheduleBook
from dips.sim import costs
from dips.sim.events import FastQueue
from dips.sim.faults import RandomFaults, ServerFaults
from dips.sim.followers import FollowerLoad, ModelledFollower, NormBoard
from dips.sim.ledger_journal import JournaledLedger
from dips.sim.member import Member
from dips.sim.messages import FOLLOWER_CALLS, Beats, Messages, beat_stream
from dips.sim.network import Job, Network
from dips.sim.rounds import RoundActions
from dips.spec.run import PUSH_TOKENS_SLACK
from dips.spec.simulate import SimScenario

__all__ = ["FOLLOWER_CALLS", "Simulation"]



class Simulation(RoundActions, ServerFaults, RandomFaults, Messages):
    """One simulated run of ``scenario``; :meth:`run` plays it to the end (the horizon, the
    token budget, or nothing left to do). Deterministic: same scenario, same result."""

    def __init__(self, scenario: SimScenario) -> None:
        sc = self.sc = scenario
        self.q = FastQueue()
        layers = costs.layer_params(sc.model)
        sizes = [p for _, p in layers]
        self.params = sum(sizes)
        wire = costs.wire_bytes_per_param(sc.outer.wire_dtype)
        self.layer_bytes = [p * wire * sc.wire_bytes_scale for p in sizes]
        M = sc.followers.count
        parts = partition_contiguous([4 * p for p in sizes], M)  # FP32 bytes, as the leader
        self.owner = {k: f for f, r in enumerate(parts) for k in r}
        self.follower_params = [sum(sizes[k] for k in r) for r in parts]
        self.loads = [FollowerLoad(f, p, sc.timeline_s) for f, p in enumerate(self.follower_params)]
        self.net = Network(self.loads, sc.followers.nic_bps, self.q)
        self.board = NormBoard(sc.norms.correlation)
        self.followers = [(f, ModelledFollower(f, p / self.params, self.board))
                          for f, p in enumerate(self.follower_params)]
        t = sc.leader.timeouts
        self.policy = RoundPolicy(sc.leader.grace, t.push_s, t.pull_s, push_slack=t.push_slack,
                                  push_floor_s=t.push_floor_s)
        self.state = RoundState()
        self.penalty = PenaltyState()
        self.version = 0
        self.book = ScheduleBook(M)
        d = sc.data
        # with leader faults its checkpoint is kept (dips.sim.faults): O(changes) each time
        journal = bool(sc.leader.faults or sc.leader.mtbf_s)
        self.ledger = (JournaledLedger if journal else ChunkLedger)(d.num_chunks,
                                                                    d.windows_per_chunk)
        self.members: dict[str, Member] = {}
        for c in sc.clusters:
            stages = partition_contiguous([4 * p for p in sizes], c.stages)
            for cid in c.ids():
                self.members[cid] = Member(cid, len(self.members), c, sc, stages)
        # The leader's bounds on one push, as a run config sets them: the most it weighs (one
        # sync interval, LeaderConfig.push_tokens_weighed) and is credited (max_push_tokens).
        self.push_tokens_weighed = max(
            m.cfg.windows_per_step * m.H for m in self.members.values()) * d.tokens_per_window
        self.max_push_tokens = PUSH_TOKENS_SLACK * self.push_tokens_weighed
        self.beats = Beats(sc.leader.membership.heartbeat_interval_s)
        self._beat_rng = beat_stream(sc.seed)
        for f in range(M):  # a follower registers when it starts (its first heartbeat)
            self._beat_from(("follower", f), "RegisterFollower", 0.0, at_once=True)
        self.msgs: Counter[str] = Counter()
        self.bins: Counter[int] = Counter()
        self.follower_bins: Counter[int] = Counter()
        self.counts: Counter[str] = Counter()
        self.reasons: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()
        self.lags: Counter[int] = Counter()
        self.rounds: list[dict[str, Any]] = []
        self.round_sizes: Counter[int] = Counter()
        self.tokens_accepted = 0
        self.end_s = 0.0
        self.finished = ""
        self._ticks: set[float] = set()
        self._gained: dict[str, int] = {}
        self.planned_faults = {(cid, f.push): f.phase for c in sc.clusters
                               for cid in c.ids() for f in c.faults}
        self._init_server_faults()
        self._init_random_faults()

    # ----- the loop -------------------------------------------------------------------------
    def run(self) -> "Simulation":
        """Play the run; returns self (read the results with :mod:`dips.sim.report`)."""
        sc = self.sc
        for m in self.members.values():
            self.q.push(m.cfg.join_s, "join", (m.cid, m.epoch))
            for link in (m.cfg.uplink, m.cfg.downlink):
                for change in (link.schedule if link is not None else []):
                    self.q.push(change.at_s, "relink")
        self.q.push(sc.horizon_s, "end", priority=9)
        # the leader reconciles the followers that registered before anything else
        # (Leader._reconcile: GetState, Restore, Abort of each); here they start reconciled
        for rpc in ("GetState", "Restore", "Abort"):
            self._message(0.0, rpc, sc.followers.count)
        t = 0.0
        while len(self.q) and not self.finished:
            t, kind, payload = self.q.pop()
            getattr(self, "_on_" + kind)(t, payload)
        self.end_s = t
        for m in self.members.values():
            m.close(t)
        for load in self.loads:
            load.close(t)
        return self

    def _feed(self, event: Any, accepted: Any = None) -> bool:
        """The leader: one event into the round machine, its actions carried out. A refused
        event is counted by its refusal code and changes nothing (returns False); else
        ``accepted()`` runs before the actions are carried out (as the leader reports a
        push's progress to the ledger)."""
        try:
            self.state, actions = round_machine.step(self.state, event, self.policy)
        except Refused as exc:
            self.refusals[exc.code.name] += 1
            return False
        if accepted is not None:
            accepted()
        now = event.now
        for a in actions:
            if isinstance(a, RoundOpened):
                self.counts["rounds"] += 1
                self._reserve(a.number)
                self._phase_entered(a.number, "window", now)
            elif isinstance(a, WindowClosed):
                self._phase_entered(a.number, "push", now)
            elif isinstance(a, Admitted) and not a.slot.done:
                self._push(self.members[a.slot.cluster_id], a.slot.round, now)
            elif isinstance(a, Staged):
                self.counts["sent_ahead"] += 1
                self._push(self.members[a.slot.cluster_id], 0, now)
            elif isinstance(a, StartUpdate):
                self._update(a, now)
            elif isinstance(a, Decided):
                self._decided(a, now)
                self._phase_entered(a.number, "pull", now)
            elif isinstance(a, RoundEnded):
                self._ended(a, now)
        deadline = round_machine.next_deadline(self.state, self.policy)
        if deadline is not None and math.isfinite(deadline) and deadline not in self._ticks:
            self._ticks.add(deadline)
            self.q.push(max(deadline, now), "tick", deadline, priority=1)
        return True

    # ----- events ---------------------------------------------------------------------------
    def _on_end(self, t: float, _: Any) -> None:
        self.finished = "horizon"

    def _on_tick(self, t: float, deadline: float) -> None:
        self._ticks.discard(deadline)
        if not self.leader_down:
            self._feed(Tick(t))

    def _on_relink(self, t: float, _: Any) -> None:
        self.net.relink(t)

    def _on_flow_start(self, t: float, flow: Any) -> None:
        self.net.start(t, flow)

    def _on_flow_done(self, t: float, payload: tuple[Any, int, tuple[int, str]]) -> None:
        flow = self.net.finish(t, *payload)
        if flow is None:
            return
        m = self.members[flow.job.cluster]
        if flow.job.direction == "in" and m.job is flow.job and self._fault_due(m, "push", t):
            return  # lost in the middle of its push (after its first layer)
        flow.job.flow_done(t, flow)

    def _on_cpu(self, t: float, payload: tuple[int, bool]) -> None:
        self.loads[payload[0]].cpu(payload[1], t)

    def _on_join(self, t: float, payload: tuple[str, int]) -> None:
        m = self.members[payload[0]]
        if payload[1] != m.epoch:
            return
        if self.leader_down:  # the client retries until the leader is back
            self._parked.append(m)
            return
        if not self.beats.is_open(m.cid):  # a new process: it fetches the spec, then beats
            self._message(t, "GetSpec")
            self._beat_from(m.cid, "Heartbeat", t)
        self._message(t, "JoinCluster")
        self.ledger.release(m.cid)  # as the leader's join: a (re-)joining cluster starts afresh
        self._feed(MemberGone(t, m.cid, "cluster re-joined"))
        m.down = False
        m.set_state("join", t)
        self._lease(m, t)
        version = self.version
        if m.epoch == 0 and not m.cfg.initial_pull:  # starts from the shared initial model
            self._joined(m, version, t)
        else:
            m.job = self._pull_job(m, lambda t2: self._joined(m, version, t2))
            m.job.begin(t)
        if m.cfg.mtbf_s is not None:
            self.q.push(t + float(m.rng["faults"].exponential(m.cfg.mtbf_s)), "fault",
                        (m.cid, m.epoch))

    def _joined(self, m: Member, version: int, t: float) -> None:
        m.base_version = version
        m.backoff_s = BACKOFF_FIRST_S
        self._compute(m, t)

    def _compute(self, m: Member, t: float) -> None:
        m.set_state("compute", t)
        m.job = None
        self.q.push(t + m.compute_s(t), "computed", (m.cid, m.epoch))

    def _on_computed(self, t: float, payload: tuple[str, int]) -> None:
        m = self.members[payload[0]]
        if payload[1] != m.epoch:
            return
        m.progress = m.train(self.ledger, lambda: self._lease(m, t))
        self._request(m, t)

    def _on_fault(self, t: float, payload: tuple[str, int], scheduled: bool = False) -> None:
        """Cluster ``payload[0]`` fails; back after an exponential draw of its ``recovery_s``
        (a ``scheduled`` fault: after exactly ``recovery_s``), removed after the heartbeats."""
        m = self.members[payload[0]]
        if payload[1] != m.epoch or m.down:
            return
        m.faults += 1
        m.epoch += 1
        m.down = True
        self.beats.stop(m.cid, t)
        if m.job is not None:
            self.net.cancel(t, m.job)
            m.job = None
        m.set_state("down", t)
        hb = self.sc.leader.membership
        detect = hb.missed_heartbeats * hb.heartbeat_interval_s
        back = max(detect, m.cfg.recovery_s if scheduled else
                   float(m.rng["faults"].exponential(m.cfg.recovery_s)))
        self.q.push(t + detect, "gone", (m.cid, m.epoch))
        self.q.push(t + back, "join", (m.cid, m.epoch), priority=1)

    def _on_gone(self, t: float, payload: tuple[str, int]) -> None:
        m = self.members[payload[0]]
        if payload[1] != m.epoch:
            return
        if self.leader_down:  # the restarted leader's monitor, after its extra intervals
            hb = self.sc.leader.membership
            self.q.push(self._leader_back_at + 2 * hb.missed_heartbeats * hb.heartbeat_interval_s,
                        "gone", payload)
            return
        self._feed(MemberGone(t, m.cid, "heartbeat timeout"))  # the leader's reason
        self.ledger.release(m.cid)
        m.positions = {}
        self._persist()

    def _on_updated(self, t: float, payload: tuple[int, Any, int]) -> None:
        number, report, life = payload
        if self.leader_down or life != self.counts["leader_restarts"]:
            return  # the leader that ran this update died
        self._update_ended(report, t)
        self._feed(UpdateFinished(t, number, report.outcome))
        reason = stop_reason(tokens_accepted=self.tokens_accepted, outer_steps=self.version,
                             training_s=t, token_budget=self.sc.token_budget)
        if reason is not None:
            self.finished = reason
        self._maybe_reconcile(t)

    # ----- what the actions start -----------------------------------------------------------
    def _lease(self, m: Member, t: float) -> None:
        """The cluster tops its chunks up to ``lease_ahead`` (a Lease call, as the client does)."""
        d = self.sc.data
        if self.leader_down:
            return
        held = self.ledger.holdings(m.cid)
        unfinished = [c for c, _ in held if c not in m.positions or
                      m.positions[c] < d.windows_per_chunk]
        want = d.lease_ahead - len(unfinished)
        if want <= 0:
            return
        self._message(t, "Lease")
        n = lease_allowed(len(held), want, d.lease_ahead, self.max_push_tokens,
                          d.tokens_per_window, d.windows_per_chunk)
        if n > 0:
            for chunk, start in self.ledger.lease(m.cid, n, t, d.lease_timeout_s):
                m.positions[chunk] = start

    def _push(self, m: Member, rnd: int, t: float) -> None:
        """Start ``m``'s push for round ``rnd`` (0: sent ahead) along the §10 schedule."""
        steps = self.book.schedule(rnd, m.stage_layers, self.owner, self.sc.followers.count)
        # per worker: (follower, bytes, transfers); a worker's back-to-back layers to one
        # follower are one flow that starts after their setups (latency_s each) together
        plan: list[list[tuple[int, float, int]]] = [[] for _ in m.stage_layers]
        merge = not m.cfg.shared_links or len(plan) == 1
        for st in steps:
            for tr in st:
                mine = plan[tr.worker]
                if merge and mine and mine[-1][0] == tr.follower:
                    f, nbytes, n = mine[-1]
                    mine[-1] = (f, nbytes + self.layer_bytes[tr.layer], n + 1)
                else:
                    mine.append((tr.follower, self.layer_bytes[tr.layer], 1))
        m.set_state("push", t)
        m.admitted_at = t
        if self._fault_due(m, "window", t):
            return  # lost once admitted, before sending anything
        m.job = Job(self.net, m.cid, "in", plan, m.cfg.uplink, m.cfg.latency_s, m.cfg.shared_links,
                    lambda t2: self._pushed(m, t2))
        m.job.begin(t)

    def _pushed(self, m: Member, t: float) -> None:
        m.last_push_s = t - m.admitted_at
        m.push_s.append(m.last_push_s)
        m.job = None
        m.set_state("verdict", t)
        if self.leader_down:
            return  # the client asks again once the leader is back
        self._message(t, "PushDone")
        self._feed(PushReported(t, m.cid, m.push_id, True))
        self._fault_due(m, "update", t)  # lost after its push, before the verdict

    def _pull_job(self, m: Member, on_done: Any) -> Job:
        """Each stage worker fetches its layers, one owning follower after another (the plan
        depends only on the member's stages and the ownership: computed once, kept)."""
        plan = m.pull_plan
        if plan is None:
            plan = m.pull_plan = []
            for layers in m.stage_layers:
                by_follower: dict[int, float] = {}
                for k in layers:
                    by_follower[self.owner[k]] = (by_follower.get(self.owner[k], 0.0)
                                                  + self.layer_bytes[k])
                plan.append(list(by_follower.items()))
        return Job(self.net, m.cid, "out", plan, m.cfg.downlink or m.cfg.uplink,
                   m.cfg.latency_s, False, on_done, merge=True)
