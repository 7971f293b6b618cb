"""What the simulated leader does with a round's update and verdicts, and the scheduled faults.

A mixin of :class:`dips.sim.engine.Simulation` (kept apart to keep each module small). The
update phase is the real :func:`dips.roles.outer_step.run_update` on modelled followers; the
ledger settles each push where the real leader does (:mod:`dips.roles.leader_push`): a decided
step (something accepted, every follower prepared) at the decision, inside ``run_update``'s
``on_decided`` and before the commits, any other round when its verdicts are out. A cluster
lost after the decision and before the verdicts (the update phase) is therefore credited,
never handed its windows out again.

A push request waits for admission until its deadline, the client's ``timeouts.admit_s``:
then it is withdrawn as the real leader withdraws it (:func:`dips.algo.hold.admission`
decides, the round machine gets ``PushWithdrawn``, the ledger drops the report), and the
cluster, holding (``hold_after = 1``: no further step), asks again with the same progress
after its backoff (:func:`dips.algo.hold.next_backoff`: 0.5 s doubling to 10 s, back to
0.5 s after a pull or a join) — each try a RequestPush to the leader.

Scheduled faults (:class:`dips.spec.simulate.SimFault`) kill a cluster at its n-th push in one
of the four cluster-side phases of :mod:`dips.roles.failpoints` (``window``, ``push``,
``update``, ``pull``); the engine asks :meth:`RoundActions._fault_due` at each of them.
"""

from __future__ import annotations

from typing import Any

from dips.algo import round as round_machine
from dips.algo.hold import BACKOFF_FIRST_S, Admission, admission, next_backoff
from dips.algo.round import Decided, PushRequested, PushWithdrawn, RoundEnded, StartUpdate
from dips.roles import outer_step
from dips.sim import costs

__all__ = ["RoundActions"]


class RoundActions:
    """The update phase, the verdicts, the pulls and the round records of a simulation.

    ``planned_faults``: (cluster id, push number) -> phase of the scheduled faults still to
    come; ``_gained``: push id -> windows its verdict accepted, until the verdict is out."""

    planned_faults: dict[tuple[str, int], str]
    _gained: dict[str, int]

    # ----- push requests and their admission deadline ---------------------------------------
    def _request(self, m: Any, t: float, retry: bool = False) -> None:
        """``m`` asks to push what it trained (``m.progress``; ``retry``: again, after its
        request was withdrawn); while the leader is down the request waits for it (the client
        retries)."""
        if self.leader_down:
            m.set_state("admit", t)
            self._parked.append(m)
            return
        per_push = self.max_push_tokens // self.sc.data.tokens_per_window
        progress = self.ledger.credit(m.cid, m.progress, per_push)
        windows = self.ledger.windows_in(m.cid, progress)
        if windows == 0:  # nothing left to train on (every free chunk is held elsewhere)
            self.counts["no_data"] += 1
            self._compute(m, t)
            return
        if retry:
            m.retry_push()
        else:
            m.new_push(t)
        m.set_state("admit", t)
        self._message(t, "RequestPush")
        ok = self._feed(PushRequested(t, m.cid, m.push_id, m.base_version,
                                      windows * self.sc.data.tokens_per_window, m.last_push_s),
                        lambda: self.ledger.report(m.cid, progress))
        if not ok:  # the run finished (or a push is still in flight): the cluster stops here
            m.set_state("stopped", t)
            self.beats.stop(m.cid, t)
        elif m.state == "admit":  # queued: withdrawn at its deadline unless admitted
            deadline = t + self.sc.leader.timeouts.admit_s
            self.q.push(deadline, "admit_deadline", (m.cid, m.epoch, m.push_id, deadline))

    def _on_admit_deadline(self, t: float, payload: tuple[str, int, str, float]) -> None:
        """A request's deadline: withdrawn if still waiting (the leader's ``request_push``),
        asked again after the cluster's backoff."""
        cid, epoch, push_id, deadline = payload
        m = self.members[cid]
        if m.epoch != epoch or m.push_id != push_id or self.leader_down:
            return  # admitted and on, failed since, or re-made to a restarted leader
        if admission(self.state, cid, push_id, deadline, t).what is not Admission.WITHDRAW:
            return
        self._feed(PushWithdrawn(t, cid, push_id))
        self.ledger.resolve(cid, False)  # the report goes with it
        self.counts["withdrawn"] += 1
        self.counts["pushes_withdrawn"] += m.tries == 1  # its first withdrawal
        self.counts["tries_max"] = max(self.counts["tries_max"], m.tries + 1)
        wait_s, m.backoff_s = m.backoff_s, next_backoff(m.backoff_s)
        self.q.push(t + wait_s, "admit_retry", (cid, epoch, push_id))

    def _on_admit_retry(self, t: float, payload: tuple[str, int, str]) -> None:
        cid, epoch, push_id = payload
        m = self.members[cid]
        if m.epoch == epoch and m.push_id == push_id and m.state == "admit":
            self._request(m, t, retry=True)


    # ----- scheduled faults -----------------------------------------------------------------
    def _fault_due(self, m: Any, phase: str, t: float) -> bool:
        """Whether ``m`` is scheduled to fail now, at its current push in ``phase``; if so it
        fails at ``t`` (:meth:`_on_fault`) and True is returned (the caller stops there)."""
        plan = self.planned_faults
        if plan.get((m.cid, m.push_no)) != phase or m.down:
            return False
        del plan[(m.cid, m.push_no)]
        self.counts["scheduled_faults"] += 1
        self._on_fault(t, (m.cid, m.epoch), scheduled=True)
        return True

    # ----- the update phase -----------------------------------------------------------------
    def _update(self, start: StartUpdate, t: float) -> None:
        """The update phase: the real :func:`run_update` on modelled followers, timed by the
        followers' cost per parameter."""
        sc, M = self.sc, self.sc.followers.count
        self._update_faults(start.number, t)
        self._updating = True
        self.board.sq_norms = {}
        for s in start.slots:
            lag = max(0, self.version - s.base_version)
            if s.ok:
                self.lags[lag] += 1
                m = self.members[s.cluster_id]
                self.board.sq_norms[s.cluster_id] = costs.push_sq_norm(
                    sc.norms, m.H, m.H, lag, m.rng["norms"])
        rnd = self.state.current
        self._follower_calls(t)  # anything left before this update
        report = outer_step.run_update(self.followers, start.number, start.slots, self.version,
                                       self.penalty, sc.penalty, sc.outer,
                                       on_decided=lambda r: self._decide(rnd, r, t),
                                       weight_cap=self.push_tokens_weighed,
                                       members=len(self.members))
        if self.leader_down:
            self._follower_calls(t)  # the calls it made before it died
            return  # died after its decision: the restarted leader takes over from there
        if not report.failed:
            self.version, self.penalty = report.outcome.version, report.penalty
        k = len(report.outcome.accepted)
        self.round_sizes[len(start.slots)] += 1
        f = sc.followers
        per_param = f.update_s_per_param + k * f.update_s_per_push_param if k else 0.0
        begin = end = t  # sequential: each follower starts when the one before finished
        applied: dict[int, float] = {}  # follower -> when its Apply's reply reaches the leader
        for (index, _), load in zip(self.followers, self.loads):
            load.memory(costs.memory_bytes(f.memory, load.params,
                                           len(start.slots) + len(self.state.staging)))
            busy = load.params * per_param
            if busy > 0:
                self.q.push(begin, "cpu", (index, True))
                self.q.push(begin + busy, "cpu", (index, False))
            end = max(end, begin + busy)
            applied[index] = begin + busy
            begin = end if f.apply == "sequential" else t
        phase = end - t + 4 * M * sc.leader.rpc_latency_s
        # the replies the leader receives, each when it arrives: Score, Aggregate / Discard /
        # Abort at once, Apply when that follower's outer step is done, Commit at the end
        self._follower_calls(t, {"Apply": applied, "Commit": {i: t + phase for i in applied}})
        self.q.push(t + phase, "updated", (start.number, report, self.counts["leader_restarts"]),
                    priority=2)

    def _decide(self, rnd: Any, report: Any, t: float) -> None:
        """A step decided (every follower prepared it): recorded before any commit, as the
        leader's ``_decide`` (version, penalty, the ledger's verdicts, then ``leader.json``)."""
        out = report.outcome
        self.version, self.penalty = out.version, report.penalty
        verdicts = round_machine.verdicts_of(rnd, out)
        self._account(verdicts, out.version)
        self._version_tokens[out.version] = self.sc.data.tokens_per_window * sum(
            self._gained.get(v.push_id, 0) for v in verdicts)
        self._recorded = {v.push_id: v for v in verdicts}
        self._decided_now(rnd.number, t)

    def _account(self, verdicts: Any, version: int | None) -> None:
        """Settle the ledger for a round's ``verdicts`` once (the leader's ``_account``;
        ``version``: the decided step, None for a round that was not decided): the windows
        newly accepted, per push id, go to ``_gained``."""
        gained = self._gained
        for v in verdicts:
            if v.push_id not in gained:
                gained[v.push_id] = self.ledger.resolve(v.cluster_id, v.accepted, version)

    # ----- verdicts and pulls ---------------------------------------------------------------
    def _decided(self, decided: Decided, t: float) -> None:
        self._account(decided.verdicts, None)  # a round not decided (nothing accepted, failed)
        self._recorded = {}
        for v in decided.verdicts:
            self._verdict(v, t)

    def _verdict(self, v: Any, t: float) -> None:
        """Verdict ``v`` is out at ``t`` (or re-served by a restarted leader): counted, and its
        cluster, unless it failed since, pulls the version it names."""
        gained = self._gained.pop(v.push_id, 0)
        self.tokens_accepted += gained * self.sc.data.tokens_per_window
        self.counts["pushes"] += 1
        self.counts["accepted" if v.accepted else "rejected"] += 1
        if not v.accepted:
            self.reasons["penalty" if v.reason.startswith("penalty") else "failed"] += 1
        m = self.members[v.cluster_id]
        m.verdict(v.accepted, gained * self.sc.data.tokens_per_window)
        if m.down or m.push_id != v.push_id:  # failed since: its new life pulls on joining
            return
        if self._fault_due(m, "pull", t):
            return
        if m.job is not None:  # its push failed (a follower down): transfers aborted
            self.net.cancel(t, m.job)
        m.positions = {c: p for c, p in self.ledger.holdings(m.cid)}
        m.set_state("pull", t)
        m.pull_started = t
        version = v.version
        m.job = self._pull_job(m, lambda t2, m=m, version=version: self._pulled(m, version, t2))
        m.job.begin(t)

    def _pulled(self, m: Any, version: int, t: float) -> None:
        m.base_version = version
        m.backoff_s = BACKOFF_FIRST_S  # a completed sync
        m.pull_s.append(t - m.pull_started)
        if self.leader_down:
            self._compute(m, t)
            return
        self._message(t, "PullDone")
        self._feed(round_machine.PullDone(t, m.cid))
        self._compute(m, t)

    def _ended(self, ended: RoundEnded, t: float) -> None:
        self.counts["rounds_ended"] += 1
        self._persist()
        if t < self.sc.timeline_s:
            self.rounds.append({"round": ended.number, "end_s": round(t, 3),
                                "window_s": round(ended.window_s, 3),
                                "push_s": round(ended.push_s, 3),
                                "update_s": round(ended.update_s, 3)})
