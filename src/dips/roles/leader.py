"""The leader: control plane of Di-PS (§5, §6, §8, §12 of the seed). Metadata only.

Every decision of the outer loop is the pure round machine of :mod:`dips.algo.round`
(phases ``idle → window → push → update → pull``, the grace window of §7, push and pull
timeouts, verdicts). This class is the thin shell around it: gRPC handlers (many threads)
turn calls into the machine's events under one lock; the loop thread sends it the clock
(:class:`dips.algo.round.Tick` at its deadlines) and carries out its actions — the update
phase (:func:`dips.roles.outer_step.run_update`: score, decide, aggregate, clip, two-phase
apply across the followers, outside the lock), the counts, the data-chunk ledger, the
outer-step log and the metadata checkpoint. The virtual-time engine drives the same machine.

Resilience (§12): clusters and followers heartbeat (:mod:`dips.roles.leader_members`); a
cluster silent for 3 intervals is removed (its data chunks return to the ledger) without
pausing anyone; a silent follower is marked down and no round opens until every follower is
up again and reconciled to one version. The leader checkpoints its metadata (membership,
version, penalty history, grace estimates, ledger, counts; a few KB) atomically and durably
after every decision and round, reserves round numbers in it before using them, and resumes
from it after a restart. Hostile members (issue 13): :mod:`dips.roles.leader_push` (what a
push may claim, admission tickets), :mod:`dips.wire.fields` and :mod:`dips.wire.inflight`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from dips.algo import ScheduleBook
from dips.algo.ledger import ChunkLedger
from dips.algo.limits import stop_reason
from dips.algo.penalty import PenaltyState
from dips.algo.reconcile import FollowerReport, reconcile_target
from dips.algo.round import (
    Decided,
    Phase,
    ReadyChanged,
    RoundEnded,
    RoundOpened,
    RoundPolicy,
    RoundState,
    RunFinished,
    StartUpdate,
    Tick,
    UpdateFinished,
    WindowClosed,
    next_deadline,
    step,
)
from dips.roles import failpoints
from dips.roles.leader_eval import EvalReports
from dips.roles.leader_members import Membership
from dips.roles.leader_push import Pushes
from dips.roles.leader_records import Records
from dips.roles.leader_types import (
    ClusterEntry,
    FollowerEntry,
    Grant,
    Issued,
    LeaderConfig,
    LeaderStatus,
    VerdictReply,
)
from dips.roles.outer_step import (
    FollowerControl,
    UpdateReport,
    abort_everywhere,
    run_update,
)
from dips.wire.control import describe

log = logging.getLogger(__name__)

__all__ = ["ClusterEntry", "FollowerControl", "FollowerEntry", "Grant", "Leader", "LeaderConfig",
           "VerdictReply"]


class Leader(Membership, Records, Pushes, EvalReports):
    """The leader's shell around the round machine; gRPC handlers call its public methods
    from many threads.

    Args:
        cfg: :class:`dips.spec.LeaderConfig` (grace, penalty, outer, membership, timeouts,
            followers).
        connect: ``FollowerEntry -> FollowerControl``, how to reach a registered follower.
        run_dir: where ``outer_steps.jsonl``, ``leader_events.jsonl`` and the metadata
            checkpoint ``leader.json`` go (None: nothing written, no resume).
        ledger: the data-chunk ledger (None: no chunk accounting; T_j is then the client's).
        clock: monotonic clock in seconds (injectable for tests).
        tokens_per_window: tokens a ledger window trains (the sequence length); with a ledger,
            each push's T_j is its windows since the last accepted push × this (§6, §12).
        issued: term, data secret, run spec and fingerprint this leader hands out
            (default: term 1, a fresh secret, no spec, no fingerprint check).

    ``roster``: a callable giving the ids of the clusters holding a valid certificate (``dips
    leader`` reads its ``clusters.txt`` less ``revoked.txt``); the robust scale counts the
    run's members as the more of ``cfg.configured_clusters`` and the union of those ids with
    the members joined (issue 13).
    """

    #: see the class docstring; None: unknown
    roster: Callable[[], set[str] | frozenset[str]] | None = None
    _unlisted: frozenset[str] = frozenset()  # members already said to be missing from it

    def __init__(self, cfg: LeaderConfig, connect: Callable[[FollowerEntry], FollowerControl],
                 run_dir: Path | None = None, ledger: ChunkLedger | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 tokens_per_window: int | None = None, issued: Issued | None = None) -> None:
        self.cfg = cfg
        self.issued = issued or Issued()
        self.fenced = threading.Event()  # set when this leader stepped down (see step_down)
        self.fenced_reason = ""
        self.tokens_per_window = tokens_per_window
        self.policy = RoundPolicy(cfg.grace, cfg.timeouts.push_s, cfg.timeouts.pull_s,
                                  push_slack=cfg.timeouts.push_slack,
                                  push_floor_s=cfg.timeouts.push_floor_s)
        self._connect = connect
        self._clock = clock
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._state = RoundState(ready=False)
        self._update: StartUpdate | None = None      # the update the loop must run next
        self._ended: list[RoundEnded] = []           # rounds whose record the loop must write
        self._reports: dict[int, UpdateReport] = {}  # round -> its update, until it is logged
        self._holdings: dict[str, list[tuple[int, int]]] = {}  # push id -> ledger positions
        self._init_membership()  # joins, the monitor's own lag (dips.roles.leader_members)
        self._init_pushes()  # its rate-limited lines (dips.roles.leader_push)
        self._decided = 0                            # the last round recorded by _decide
        self._recorded: dict[str, Any] = {}          # its verdicts, until the machine has them
        self._leaving: set[str] = set()              # removed; ledger release after the verdicts
        self.followers: dict[int, FollowerEntry] = {}
        self._superseded: dict[int, list[int]] = {}  # index -> incarnations replaced since
        self._member_keys: dict[str, str] = {}  # identity -> its current data-plane key id
        self._key_seq = 0                       # the next key's issue sequence number
        self.clusters: dict[str, ClusterEntry] = {}
        self.version = 0
        self.penalty = PenaltyState()
        self.ledger = ledger
        self.counts = {"updates_pushed": 0, "updates_accepted": 0, "updates_rejected": 0,
                       "tokens_pushed": 0, "tokens_accepted": 0, "outer_steps": 0,
                       "outer_steps_lost": 0, "restarts": 0}
        self.needs_reconcile = True
        self.followers_epoch = 0  # see HeartbeatAnswer
        self._version_stats: dict[int, tuple[int, int]] = {}
        #: cluster -> {"tokens_pushed", "tokens_accepted"} over all its processes (tokens)
        self.cluster_counts: dict[str, dict[str, int]] = {}
        self._version_cluster_tokens: dict[int, dict[str, int]] = {}  # version -> accepted T_j
        self.training_started_at: float | None = None  # wall clock of the first push request
        self._layer_owner: dict[str, int] = {}
        self._book = ScheduleBook()  # follower use across the clusters of a round (§10)
        self._run_dir = run_dir
        self.rounds_reserved = 0  # the highest round it may open before writing leader.json
        self._known_followers: dict[int, str] = {}  # from leader.json, until they register
        self._threads = [threading.Thread(target=self._loop, name="leader-loop", daemon=True),
                         threading.Thread(target=self._monitor, name="leader-monitor", daemon=True)]
        if run_dir is not None:
            self._resume(run_dir / "leader.json")
        self._init_evals()  # eval.jsonl: the held-out series (issue 15)

    # ----- lifecycle -------------------------------------------------------------------
    @property
    def phase(self) -> str:
        """The round machine's phase (``idle``, ``window``, ``push``, ``update``, ``pull``)."""
        return self._state.phase.value

    @property
    def rounds(self) -> int:
        """The last round number opened: the rounds opened so far, except that a restarted
        leader continues above every number its previous incarnation reserved
        (:meth:`reserve_rounds`), so it may skip some."""
        return self._state.rounds

    @property
    def term(self) -> int:
        """This leader's term (fencing token)."""
        return self.issued.term

    def step_down(self, reason: str) -> None:
        """Stop acting at once: a leader of a higher term leads (or holds) the followers.
        The process exits when it sees :attr:`fenced` set. Safe from any thread."""
        if self.fenced.is_set():
            return
        self.fenced_reason = reason
        log.error("leader term %d steps down: %s", self.term, reason)
        self.event("leader_stepped_down", term=self.term, reason=reason)
        self._stop.set()
        self.fenced.set()
        with self._cond:
            self._cond.notify_all()

    def start(self) -> "Leader":
        self.reserve_rounds(self.rounds)  # this incarnation's first rounds need no write
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout_s)

    # ----- the round machine (pushes and pulls: dips.roles.leader_push) --------------------
    def _apply(self, event: Any) -> None:
        """Feed one event to the round machine and carry out its actions (lock held).

        Raises :class:`Refused` (the state is then unchanged) as :func:`dips.algo.round.step`.
        """
        self._sync_ready(event.now)
        self._carry(*step(self._state, event, self.policy))

    def _sync_ready(self, now: float) -> None:
        """Tell the machine when the followers' readiness changed (lock held)."""
        ready = self.ready
        if self._state.ready != ready:
            down = sorted(f.index for f in self.followers.values() if not f.up)
            reason = (f"follower {', '.join(map(str, down))} down" if down else
                      "followers missing or being reconciled")
            self._carry(*step(self._state, ReadyChanged(now, ready, reason), self.policy))

    def _carry(self, state: RoundState, actions: list) -> None:
        self._state = state
        for a in actions:
            if isinstance(a, RoundOpened):
                if a.number > self.rounds_reserved:  # durable before any grant of it leaves
                    self.reserve_rounds(a.number - 1)
                failpoints.hit("window")
            elif isinstance(a, WindowClosed):
                failpoints.hit("push")
            elif isinstance(a, StartUpdate):
                self._update = a
            elif isinstance(a, Decided):
                self._settle(a)
            elif isinstance(a, RoundEnded):
                self._ended.append(a)
        self._cond.notify_all()

    # ----- the loop thread: clock, reconciliation, update phase ---------------------------
    def _check_limits(self) -> bool:
        """End the run once :func:`dips.algo.limits.stop_reason` says so (lock held);
        returns whether it ended now."""
        if self._state.finished:
            return False
        c = self.cfg
        training_s = (time.time() - self.training_started_at
                      if self.training_started_at is not None else None)
        reason = stop_reason(tokens_accepted=self.counts["tokens_accepted"],
                             outer_steps=self.counts["outer_steps"], training_s=training_s,
                             token_budget=c.token_budget, max_outer_steps=c.max_outer_steps,
                             max_time_s=c.max_time_s)
        if reason is None:
            return False
        dropped = [*self._state.queue, *self._state.staging.values()]
        self._apply(RunFinished(self._clock(), reason))
        if self.ledger is not None:
            for s in dropped:  # queued or sent ahead: their progress reports go with them
                self.ledger.resolve(s.cluster_id, False)
        return True

    def _announce_finished(self) -> None:
        s = self.status()
        log.info("run finished (%s): version %d, %d outer steps, %d tokens accepted%s; "
                 "serving the final model until stopped", s.finished, s.version,
                 s.counts["outer_steps"], s.counts["tokens_accepted"],
                 "" if s.phase == "idle" else " (the round in flight still completes)")
        self.event("run_finished", reason=s.finished, version=s.version,
                   tokens_accepted=s.counts["tokens_accepted"])
        self.checkpoint()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                finished_now = self._check_limits()  # max_time_s passes between updates
            if finished_now:
                self._announce_finished()
            with self._cond:
                update, self._update = self._update, None
                reconcile = (update is None and self.needs_reconcile
                             and len(self.followers) == self.cfg.followers
                             and all(f.up for f in self.followers.values()))
                if update is None and not reconcile:
                    self._apply(Tick(self._clock()))
                    update, self._update = self._update, None
                ended, self._ended = self._ended, []
                if update is None and not reconcile and not ended:
                    if self._state.phase is Phase.IDLE:
                        failpoints.hit("idle")  # fault injection: nothing in flight
                    deadline = next_deadline(self._state, self.policy)
                    wait = 0.5 if deadline is None else deadline - self._clock()
                    self._cond.wait(min(0.5, max(wait, 0.0)))
                    continue
            for rec in ended:
                self._log_round(rec)
            if reconcile:
                self._reconcile()
            elif update is not None:
                self._run_update(update)

    def _roster(self) -> set[str]:
        """Clusters holding a valid certificate (``roster``; empty when unknown or unreadable).
        A joined member missing from a non-empty roster means the leader's list is stale (the
        operator did not copy ``clusters.txt`` after ``--add-cluster``): it is said once per
        member, and the members joined count anyway (review 19, A′)."""
        if self.roster is None:
            return set()
        try:
            ids = {str(c) for c in self.roster()}
        except Exception as exc:  # a file being replaced: the other counts still hold
            log.warning("cannot count the run's clusters: %s", exc)
            return set()
        unlisted = set(self.clusters) - ids - self._unlisted if ids else set()
        for cid in sorted(unlisted):
            log.warning("cluster %s joined but is not in the leader's clusters.txt: copy "
                        "pki/leader/clusters.txt from `dips init` to the leader's --tls "
                        "directory", cid)
        self._unlisted = self._unlisted | unlisted  # an instance's own set, never the class's
        return ids

    def _run_update(self, update: StartUpdate) -> None:
        """Carry out the machine's update phase (outside the lock: followers are called)."""
        followers = [(f.index, f.control) for f in self.follower_list()]
        with self._cond:
            version, penalty = self.version, self.penalty
            members = max(self.cfg.configured_clusters,
                          len(self._roster() | set(self.clusters)))
        report = run_update(followers, update.number, update.slots, version, penalty,
                            self.cfg.penalty, self.cfg.outer,
                            on_decided=lambda r: self._decide(update.number, r),
                            weight_cap=self.cfg.push_tokens_weighed or self.cfg.max_push_tokens,
                            members=members)
        with self._cond:
            if report.failed:
                self.needs_reconcile = True
            elif not report.outcome.accepted:
                self.penalty = report.penalty
            if report.commit_failed:
                self.commit_failed(report.commit_failed)
            self._reports[update.number] = report
            # Before the machine may open the next round from its queue (found by a review:
            # a queued push made one outer step beyond max_outer_steps).
            finished_now = self._check_limits()
            self._apply(UpdateFinished(self._clock(), update.number, report.outcome))
        if finished_now:
            self._announce_finished()
        failpoints.hit("pull")

    def commit_failed(self, failed: list[int]) -> None:
        """Some follower did not commit: reconcile before the next round."""
        with self._cond:
            self.needs_reconcile = True
            for i in failed:
                self.followers[i].up = False
            self.followers_epoch += 1

    def _reconcile(self) -> None:
        """Bring every follower to one common version (§12); see :mod:`dips.algo.reconcile`.

        The target is the newest version every follower can reach, capped at the leader's last
        recorded decision; steps above it are lost and their data goes back to the ledger.
        """
        followers = self.follower_list()
        try:
            reports = []
            for f in followers:
                version, prepared, ckpts = f.control.report()
                reports.append(FollowerReport(f.index, version, prepared, tuple(ckpts)))
            with self._cond:
                decided = self.version
            target = reconcile_target(reports, cap=decided)
            for f in followers:
                f.control.restore(target)
            abort_everywhere([(f.index, f.control) for f in followers], None)
        except Exception as exc:
            self.event("reconcile_failed", error=describe(exc))
            self._stop.wait(1.0)
            return
        lost = max(0, decided - target)
        with self._cond:
            changed = target != self.version or lost
            self.version = target
            windows_lost = 0
            if lost:
                # The lost outer steps' updates and data no longer count: the ledger hands
                # their windows out again (§12; nothing lost, nothing counted twice).
                for v in [v for v in self._version_stats if v > target]:
                    n, tokens = self._version_stats.pop(v)
                    self._count("updates_accepted", -n)
                    self._count("updates_lost", n)
                    self._count("tokens_accepted", -tokens)
                    self._count("outer_steps", -1)
                for v in [v for v in self._version_cluster_tokens if v > target]:
                    for c, t in self._version_cluster_tokens.pop(v).items():
                        self._count_cluster(c, "tokens_accepted", -t)
                if self.ledger is not None:
                    windows_lost = self.ledger.rollback(target)
            self._count("outer_steps_lost", lost)
            self.needs_reconcile = False
            self._apply(Tick(self._clock()))  # readiness changed: queued requests may go
        self.event("reconciled", version=target, lost=lost, changed=bool(changed),
                   windows_lost=windows_lost)
        if lost:
            self._write({"event": "rollback", "version": target, "lost": lost, "time": time.time()})
        self.checkpoint()

    # ----- status ----------------------------------------------------------------------
    def ledger_summary(self) -> dict[str, Any] | None:
        """The data-chunk ledger's counts (:meth:`dips.algo.ledger.ChunkLedger.summary`:
        epoch, accepted windows, finished/held/free chunks; ``counts``: chunks leased,
        accepted and returned over the run), or None without a ledger."""
        with self._cond:
            led = self.ledger
            return None if led is None else {**led.summary(), "counts": dict(led.counts)}

    def status(self) -> LeaderStatus:
        """A consistent snapshot of the run (copies; safe to read without the lock)."""
        with self._cond:
            led = self.ledger.summary() if self.ledger else {"epoch": 0, "accepted_windows": 0}
            return LeaderStatus(self.version, self.rounds, self.phase, dict(self.counts),
                                [replace(c, **self.cluster_counts.get(c.cluster_id, {}))
                                 for c in self.clusters.values()],
                                [replace(f) for f in self.followers.values()],
                                sum(f.up for f in self.followers.values()),
                                led["accepted_windows"], led["epoch"], self._state.finished,
                                self._clock(), self.cfg.followers)
