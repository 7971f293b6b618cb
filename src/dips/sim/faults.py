"""Follower and leader faults of a simulated run, decided as the real leader decides them (§12).

A mixin of :class:`dips.sim.engine.Simulation`. What decides is the leader's own code: the round
machine told that the followers stopped or started being ready
(:class:`dips.algo.round.ReadyChanged`: a round in its window or push phase then ends at once,
its pushes failed with the leader's reason ``"follower N down"``),
:func:`dips.roles.outer_step.run_update` failing a round whose follower does not answer, the
target version of :func:`dips.algo.reconcile.target <dips.algo.reconcile.reconcile_target>`
asked of the modelled followers' reports, and the ledger's
:meth:`~dips.algo.ledger.ChunkLedger.rollback` of the steps lost. The shell around them is
:meth:`dips.roles.leader.Leader._reconcile`, ``_sync_ready``, ``_monitor`` and
:meth:`dips.roles.leader_records.Records._resume` carried over to simulated time:

* **A follower** (:class:`dips.spec.simulate.SimFollowerFault`) stopped or killed: its data plane
  stalls (:meth:`dips.sim.network.Network.set_down`), its calls fail; the leader marks it down
  after the missed heartbeats (a kill's restart that registers sooner tells it sooner, as a new
  incarnation), so the followers are no longer ready. When every follower is up again and no
  update is running, the leader reconciles them to one version (instantaneous here) and they
  are ready again; a killed follower comes back from its newest checkpoint
  (:meth:`dips.sim.followers.ModelledFollower.restarted`), so the steps above it are rolled
  back everywhere, with their tokens and ledger windows.
* **The leader** (:class:`dips.spec.simulate.SimLeaderFault`) killed: what it persisted last
  (``leader.json``: taken where the leader checkpoints — a round number block reserved, a step
  decided, a round ended, followers reconciled, a member removed) is all its restart has. While
  it is down, clusters finish the sync interval they are in and their push requests wait for
  it (the real clusters' hold, :mod:`dips.algo.hold` with ``inner.hold_after = 1``). It
  resumes (the followers not ready until reconciled, a step decided before its death rolled forward), re-serves the
  verdicts it persisted, and a cluster whose push it no longer knows (``UNKNOWN_PUSH``) re-joins,
  as :mod:`dips.roles.client_sync` does; a request still waiting for admission is made again.

* **Random faults** (:class:`RandomFaults`): with ``followers.mtbf_s`` each follower fails
  after an exponential time of that mean (counted from when it is back), stopped or killed as
  ``followers.fault_action`` says, for ``fault_down_s`` seconds (a killed one restarts
  ``fault_checkpoint_lag`` versions behind); with ``leader.mtbf_s`` the leader crashes likewise
  and serves again ``leader.restart_s`` seconds later. They are carried out by the code of the
  scheduled ones above (``_on_follower_fault``, ``_on_leader_fault`` and all that follows);
  only their time is drawn instead of named by a round and phase. The one difference: the
  simulated update phase makes its calls to the followers at its start (the outer step's
  seconds are charged after them), so a fault inside an update's modelled seconds acts as one
  right after its commits.
  The draws come from their own generators (:func:`server_streams`: one per follower and one
  for the leader, from the scenario's seed), so a run without random server faults is the
  same as before, and each follower's faults do not shift with the others'.

``fault_log``: (seconds, what, details) of every fault, detection, restart and reconciliation.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from dips.algo import grace as grace_rules
from dips.algo.penalty import PenaltyState
from dips.algo.reconcile import FollowerReport, ReconcileError, reconcile_target
from dips.algo.round import ReadyChanged, RoundState
from dips.roles.leader_records import ROUND_BLOCK, VERDICTS_PERSISTED
from dips.roles.outer_step import abort_everywhere
from dips.sim.followers import FollowerDown
from dips.sim.ledger_journal import JournaledLedger

__all__ = ["RandomFaults", "RandomFollowerFault", "RandomLeaderFault", "ServerFaults",
           "server_streams"]


class ServerFaults:
    """Follower and leader faults (see the module docstring)."""

    def _init_server_faults(self) -> None:
        sc = self.sc
        self.follower_plan: dict[tuple[int, str], list[Any]] = {}
        for f in sc.followers.faults:
            self.follower_plan.setdefault((f.round, f.phase), []).append(f)
        self.leader_plan = {(f.round, f.phase): f for f in sc.leader.faults}
        self.follower_up = [True] * sc.followers.count  # as the leader believes
        self._follower_gen = [0] * sc.followers.count
        self.needs_reconcile = False
        self.leader_down = False
        self._leader_back_at = 0.0
        self._updating = False
        self._parked: list[Any] = []  # members whose request or join waits for the leader
        self._version_tokens: dict[int, int] = {}  # version -> tokens its step accepted
        self._recorded: dict[str, Any] = {}  # the verdicts of a step decided, until out
        self.fault_log: list[tuple[float, str, Any]] = []
        self.rounds_reserved = 0
        self._reserve(1)  # the leader's start: the first block reserved, leader.json written

    # ----- where faults hit -----------------------------------------------------------------
    def _phase_entered(self, number: int, phase: str, t: float) -> None:
        """Round ``number`` entered ``phase`` at ``t``: its scheduled faults fire (as events
        at ``t``, so the actions of this step are carried out first)."""
        for f in self.follower_plan.pop((number, phase), []):
            self.q.push(t, "follower_fault", f)
        lf = self.leader_plan.pop((number, phase), None)
        if lf is not None:
            self.q.push(t, "leader_fault", lf)

    def _update_faults(self, number: int, t: float) -> None:
        """Follower faults of round ``number``'s update phase: they hit inside Apply, before
        the step is prepared everywhere (the follower's ``update`` failpoint)."""
        for f in self.follower_plan.pop((number, "update"), []):
            self._on_follower_fault(t, f)

    def _decided_now(self, number: int, t: float) -> None:
        """The step of round ``number`` is decided (every follower prepared it): the leader
        records it durably; a leader fault of its update phase kills it here, before any
        commit is sent."""
        self._persist()
        lf = self.leader_plan.pop((number, "update"), None)
        if lf is not None:
            self._on_leader_fault(t, lf)

    # ----- followers ------------------------------------------------------------------------
    def _on_follower_fault(self, t: float, f: Any) -> None:
        control = self.followers[f.follower][1]
        control.alive = False
        self.beats.stop(("follower", f.follower), t)
        self.net.set_down(t, f.follower, True)
        self._follower_gen[f.follower] += 1
        gen = self._follower_gen[f.follower]
        hb = self.sc.leader.membership
        self.fault_log.append((t, f"follower_{f.action}", f.follower))
        self.q.push(t + hb.missed_heartbeats * hb.heartbeat_interval_s, "follower_silent",
                    (f.follower, gen))
        self.q.push(t + f.down_s, "follower_back", (f, gen), priority=1)

    def _on_follower_silent(self, t: float, payload: tuple[int, int]) -> None:
        i, gen = payload
        if gen != self._follower_gen[i] or self.followers[i][1].alive or self.leader_down:
            return
        if self.follower_up[i]:  # the monitor: silent for its missed heartbeats
            self.follower_up[i] = False
            self.needs_reconcile = True
            self.fault_log.append((t, "follower_down", i))
            self._sync_ready(t)

    def _on_follower_back(self, t: float, payload: tuple[Any, int]) -> None:
        f, gen = payload
        if gen != self._follower_gen[f.follower]:
            return
        control = self.followers[f.follower][1]
        control.alive = True
        if f.action == "kill":  # a new process: registers at once, then from a drawn offset
            self._beat_from(("follower", f.follower), "RegisterFollower", t, at_once=True)
        else:  # resumed: its loop's wait ran out while stopped, it registers now
            self.beats.start(("follower", f.follower), "RegisterFollower", t)
        self.net.set_down(t, f.follower, False)
        if f.action == "kill":
            control.restarted(f.checkpoint_lag)
        if f.action == "kill" or not self.follower_up[f.follower]:
            # registers: a new incarnation, or one marked down (a stop shorter than the
            # detection is a late heartbeat)
            self.follower_up[f.follower] = True
            self.needs_reconcile = True
            self.fault_log.append((t, "follower_up", f.follower))
        if not self.leader_down:
            self._sync_ready(t)
            self._maybe_reconcile(t)  # also a reconciliation that failed while it was silent

    def _sync_ready(self, t: float) -> None:
        """Tell the round machine when the followers' readiness changed (the leader's
        ``_sync_ready``, with its reasons)."""
        ready = all(self.follower_up) and not self.needs_reconcile
        if self.state.ready == ready or self.leader_down:
            return
        down = [str(i) for i, up in enumerate(self.follower_up) if not up]
        reason = (f"follower {', '.join(down)} down" if down else
                  "followers missing or being reconciled")
        self._feed(ReadyChanged(t, ready, reason))

    def _update_ended(self, report: Any, t: float) -> None:
        """After an update phase (before its UpdateFinished): a round that failed, or a commit
        that did not land, needs a reconciliation (the leader's ``_run_update``)."""
        self._updating = False
        if report.failed:
            self.needs_reconcile = True
        for i in report.commit_failed:
            self.needs_reconcile = True
            self.follower_up[i] = False
        self._sync_ready(t)

    def _maybe_reconcile(self, t: float) -> None:
        """Reconcile once every follower is up and no update runs (the leader's loop):
        :func:`reconcile_target` of their reports, capped at the last decided version, each
        restored to it; the steps above it are lost (tokens, and the ledger's windows by
        :meth:`ChunkLedger.rollback`)."""
        if not (self.needs_reconcile and all(self.follower_up)) or self._updating \
                or self.leader_down:
            return
        try:
            reports = [FollowerReport(i, *f.report()) for i, f in self.followers]
            target = reconcile_target(reports, cap=self.version)
            for _, f in self.followers:
                f.restore(target)
        except (FollowerDown, ReconcileError) as exc:  # tried again when a follower is back
            self.fault_log.append((t, "reconcile_failed", str(exc)))
            self._follower_calls(t)
            return
        abort_everywhere(self.followers, None)
        self._follower_calls(t)  # GetState, Restore, Abort of each follower
        lost = max(0, self.version - target)
        windows_lost = 0
        if lost:
            for v in [v for v in self._version_tokens if v > target]:
                self.tokens_accepted -= self._version_tokens.pop(v)
            windows_lost = self.ledger.rollback(target)
            self.counts["outer_steps_lost"] += lost
        self.version = target
        self.needs_reconcile = False
        self.fault_log.append((t, "reconciled", {"version": target, "lost": lost,
                                                 "windows_lost": windows_lost}))
        self._persist()
        self._sync_ready(t)

    # ----- the leader -----------------------------------------------------------------------
    def _reserve(self, number: int) -> None:
        """Round ``number`` opens: a new block of numbers is reserved durably first."""
        if number > self.rounds_reserved:
            self.rounds_reserved = number - 1 + ROUND_BLOCK
            self._persist()

    def _persist(self) -> None:
        """What ``leader.json`` holds now (:meth:`dips.roles.leader_records.Records.checkpoint`),
        plus the simulator's own counts of the same moment; kept only when a leader fault is
        scheduled or drawn (``leader.mtbf_s``); the ledger's part is
        :meth:`~dips.sim.ledger_journal.JournaledLedger.checkpoint`, O(changes since the last
        one), equal to its ``to_dict()``."""
        if not (self.sc.leader.faults or self.sc.leader.mtbf_s):
            return
        st = self.state
        known = {**st.verdicts, **self._recorded}
        self.persisted = {
            "version": self.version, "rounds": st.rounds, "rounds_reserved": self.rounds_reserved,
            "finished": st.finished, "penalty": self.penalty.to_dict(),
            "ledger": self.ledger.checkpoint(), "grace": grace_rules.to_dict(st.grace),
            "push_s": dict(st.push_s), "send_ahead": dict(st.send_ahead),
            "stalls": dict(st.stalls), "verdicts": list(known.values())[-VERDICTS_PERSISTED:],
            "tokens_accepted": self.tokens_accepted, "gained": dict(self._gained),
            "version_tokens": dict(self._version_tokens)}

    def _on_leader_fault(self, t: float, lf: Any) -> None:
        self.leader_down = True
        self.beats.leader(t, down=True)
        self._leader_back_at = t + lf.restart_s
        for _, f in self.followers:
            f.commits_lost = True  # a step decided now is never committed by this leader
        self.fault_log.append((t, "leader_killed", self.state.phase.value))
        self.q.push(t + lf.restart_s, "leader_back", None, priority=1)

    def _on_leader_back(self, t: float, _: Any) -> None:
        """The restarted leader resumes from :attr:`persisted` (the leader's ``_resume``)."""
        p = self.persisted
        self.leader_down = False
        self.beats.leader(t, down=False)
        for i, f in self.followers:  # dips.node.leader.take_leases: each one it knew, fenced
            if f.alive:
                self._message(t, "Fence")
        self.version = p["version"]
        self.state = RoundState(rounds=max(p["rounds"], p["rounds_reserved"]), ready=False,
                                verdicts={v.push_id: v for v in p["verdicts"]},
                                grace=grace_rules.from_dict(p["grace"]), push_s=p["push_s"],
                                send_ahead=p["send_ahead"], stalls=p["stalls"],
                                finished=p["finished"])
        self.rounds_reserved = self.state.rounds
        self.penalty = PenaltyState.from_dict(p["penalty"])
        self.ledger = JournaledLedger.from_dict(p["ledger"])
        self.ledger.pending.clear()  # pushes in flight at the crash are lost
        self.tokens_accepted = p["tokens_accepted"]
        self._gained, self._version_tokens = dict(p["gained"]), dict(p["version_tokens"])
        self._recorded, self._ticks, self._updating = {}, set(), False
        self.counts["leader_restarts"] += 1
        for _, f in self.followers:
            f.commits_lost = False
        self.needs_reconcile = True
        self.follower_up = [f.alive for _, f in self.followers]  # the ones that register
        self.fault_log.append((t, "leader_resumed", self.version))
        parked, self._parked = self._parked, []
        for m in self.members.values():
            held = {c for c, _ in self.ledger.holdings(m.cid)}
            # chunks the restored ledger does not give it (leased after the last checkpoint):
            # the real client's request is refused (LEDGER_CONFLICT); here it re-joins
            stale = bool(set(m.progress if m.state == "admit" else m.positions) - held)
            if m.down or (m in parked and m.state != "admit"):
                continue  # failed since, or its join is made now
            if m in parked:  # asked while the leader was down
                if stale:
                    parked.remove(m)
                    self._rejoin(m, t)
                continue
            verdict = self.state.verdicts.get(m.push_id)
            if m.state in ("push", "verdict") and verdict is not None:
                self._message(t, "PushDone")
                self._verdict(verdict, t)  # asked again: the verdict is re-served
            elif m.state == "admit" and not stale:
                parked.append(m)  # its request was queued, never admitted: made again
            elif m.state in ("admit", "push", "verdict") or stale:
                self._rejoin(m, t)  # UNKNOWN_PUSH: it gives its push up and re-joins
        self._maybe_reconcile(t)  # (its rollback may take back chunks a request carries)
        for m in parked:
            if m.state == "admit" and set(m.progress) - {c for c, _ in self.ledger.holdings(m.cid)}:
                self._rejoin(m, t)  # LEDGER_CONFLICT: the client re-syncs (here: re-joins)
            elif m.state == "admit":
                self._request(m, t)
            else:
                self.q.push(t, "join", (m.cid, m.epoch))

    def _rejoin(self, m: Any, t: float) -> None:
        """``m`` drops what it was doing and joins again (pulling the whole model)."""
        if m.job is not None:
            self.net.cancel(t, m.job)
            m.job = None
        m.epoch += 1
        self.counts["rejoins"] += 1
        self.q.push(t, "join", (m.cid, m.epoch))


#: Second word of the seed of the server-fault generators (cluster streams use [seed, index]).
_SERVER_STREAM = 0x5E4FA17


class RandomFollowerFault(NamedTuple):
    """What a drawn follower fault does (the fields :class:`dips.spec.simulate.SimFollowerFault`'s
    handlers read): follower index, ``stop`` or ``kill``, seconds down, checkpoint lag."""

    follower: int
    action: str
    down_s: float
    checkpoint_lag: int


class RandomLeaderFault(NamedTuple):
    """A drawn leader crash: seconds until the restarted leader serves."""

    restart_s: float


def server_streams(seed: int, followers: int) -> list[np.random.Generator]:
    """Independent generators for followers 0 … ``followers`` - 1 and, last, the leader."""
    children = np.random.SeedSequence([seed, _SERVER_STREAM, 0]).spawn(followers + 1)
    return [np.random.Generator(np.random.PCG64(c)) for c in children]


class RandomFaults:
    """Random follower and leader faults (see the module docstring)."""

    def _init_random_faults(self) -> None:
        sc = self.sc
        f, lead = sc.followers, sc.leader
        if f.mtbf_s is None and lead.mtbf_s is None:
            return
        self._server_rng = server_streams(sc.seed, f.count)
        if f.mtbf_s is not None:
            for i in range(f.count):
                self.q.push(float(self._server_rng[i].exponential(f.mtbf_s)),
                            "random_follower_fault", i)
        if lead.mtbf_s is not None:
            self.q.push(float(self._server_rng[-1].exponential(lead.mtbf_s)),
                        "random_leader_fault")

    def _on_random_follower_fault(self, t: float, i: int) -> None:
        """Follower ``i`` fails now (unless a scheduled fault has it down already); its next
        fault is drawn from when it is back."""
        f = self.sc.followers
        if self.followers[i][1].alive:
            self.counts["random_follower_faults"] += 1
            self._on_follower_fault(t, RandomFollowerFault(i, f.fault_action, f.fault_down_s,
                                                           f.fault_checkpoint_lag))
        self.q.push(t + f.fault_down_s + float(self._server_rng[i].exponential(f.mtbf_s)),
                    "random_follower_fault", i)

    def _on_random_leader_fault(self, t: float, _: Any) -> None:
        """The leader crashes now (unless it is down already); its next crash is drawn from
        when it serves again."""
        lead = self.sc.leader
        if not self.leader_down:
            self.counts["random_leader_faults"] += 1
            self._on_leader_fault(t, RandomLeaderFault(lead.restart_s))
        self.q.push(t + lead.restart_s + float(self._server_rng[-1].exponential(lead.mtbf_s)),
                    "random_leader_fault")
