"""The leader: control plane of Di-PS (§5, §6, §8, §12 of the seed). Metadata only.

The outer loop of §6 as a state machine with phases ``idle → window → push → update → pull``:

* ``idle``: no request pending; the loop waits (the server never updates with nothing to do).
* ``window``: the first push request opens the grace window; every request that arrives
  before it closes joins the same outer step (round), receiving a push id and a §10 schedule.
* ``push``: the window has closed; the leader waits until every admitted cluster reported its
  push done (or the push timeout passes; a late push is dropped). Later requests queue.
* ``update``: :func:`dips.roles.leader_step.outer_step`: penalty over the summed ‖Δ‖²,
  token weights, one clip factor, a two-phase apply on every follower.
* ``pull``: every cluster of the round is told the version to pull. By default the next
  round opens at once: the clusters pull their version from the followers' per-version
  snapshots while new pushes arrive, so a slow link delays only its own cluster (measured in
  virtual time on the slow-link scenario: Di-PS 1.11x instead of 0.95x synchronous DiLoCo).
  With ``LeaderConfig.pull_barrier`` (the seed's §6 round) it opens when all have pulled or
  the pull timeout passes; a cluster that pulled and requests again meanwhile is queued.

Resilience (§12): clusters and followers heartbeat; a cluster silent for 3 intervals is
removed (its data chunks return to the ledger) without pausing anyone; a silent follower is
marked down and no round opens until every follower is up again and reconciled to one
version. The leader checkpoints its metadata (membership, version, penalty history, ledger,
counts; a few KB) atomically after every round and resumes from it after a restart.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Callable

from dips.algo import GraceWindow, PenaltyState, ScheduleBook
from dips.algo.ledger import ChunkLedger
from dips.roles import failpoints, leader_step
from dips.wire.control import PreconditionError, UnavailableError

log = logging.getLogger(__name__)


from dips.roles.leader_members import Membership
from dips.roles.leader_types import (ClusterEntry, FollowerControl, FollowerEntry, LeaderConfig,
                                     Push, Round)

__all__ = ["ClusterEntry", "FollowerControl", "FollowerEntry", "Leader", "LeaderConfig", "Push",
           "Round"]


class Leader(Membership):
    """The leader's state machine; gRPC handlers call its public methods from many threads.

    Args:
        cfg: :class:`LeaderConfig`.
        connect: ``FollowerEntry -> FollowerControl``, how to reach a registered follower.
        run_dir: where ``outer_steps.jsonl``, ``leader_events.jsonl`` and the metadata
            checkpoint ``leader.json`` go (None: nothing written, no resume).
        ledger: the data-chunk ledger (None: no chunk accounting).
        clock: monotonic clock in seconds (injectable for tests).
    """

    def __init__(self, cfg: LeaderConfig, connect: Callable[[FollowerEntry], FollowerControl],
                 run_dir: Path | None = None, ledger: ChunkLedger | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self._connect = connect
        self._clock = clock
        self._window = GraceWindow(cfg.grace_mode, cfg.grace_window_s, cfg.grace_max_s)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.followers: dict[int, FollowerEntry] = {}
        self.clusters: dict[str, ClusterEntry] = {}
        self.version = 0
        self.rounds = 0
        self.phase = "idle"
        self.penalty = PenaltyState()
        self.ledger = ledger
        self.counts = {"updates_pushed": 0, "updates_accepted": 0, "updates_rejected": 0,
                       "tokens_pushed": 0, "tokens_accepted": 0, "outer_steps": 0,
                       "outer_steps_lost": 0, "restarts": 0}
        self.needs_reconcile = True
        self._version_stats: dict[int, tuple[int, int]] = {}
        self._queue: list[Push] = []
        self._round: Round | None = None
        self._layer_owner: dict[str, int] = {}
        self._book = ScheduleBook()  # follower use across the clusters of a round (§10)
        self._run_dir = run_dir
        self._threads = [threading.Thread(target=self._loop, name="leader-loop", daemon=True),
                         threading.Thread(target=self._monitor, name="leader-monitor", daemon=True)]
        if run_dir is not None:
            self._resume(run_dir / "leader.json")

    # ----- lifecycle -------------------------------------------------------------------
    def start(self) -> "Leader":
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

    def _resume(self, path: Path) -> None:
        state = leader_step.load_state(path)
        if state is None:
            return
        self.version, self.rounds = state["version"], state["rounds"]
        self.counts.update(state["counts"])
        self.counts["restarts"] += 1
        self.penalty = PenaltyState.from_dict(state["penalty"])
        self._version_stats = {int(v): (int(x[0]), int(x[1]))
                               for v, x in state.get("version_stats", {}).items()}
        self._window.restore(state.get("grace", {}))
        # Members get a few extra intervals to find the restarted leader before removal.
        grace = self._clock() + 2 * self.cfg.missed_heartbeats * self.cfg.heartbeat_interval_s
        self.clusters = {c: ClusterEntry(c, stages, last_seen=grace)
                         for c, stages in state["clusters"].items()}
        if self.ledger is not None and state.get("ledger"):
            self.ledger = ChunkLedger.from_dict(state["ledger"])
            self.ledger.pending.clear()  # pushes in flight at the crash are lost
        self.event("leader_resumed", version=self.version, rounds=self.rounds)

    def checkpoint(self) -> None:
        """Write ``leader.json`` (metadata only; a few KB) atomically."""
        if self._run_dir is None:
            return
        with self._cond:
            state = {"version": self.version, "rounds": self.rounds, "counts": dict(self.counts),
                     "penalty": self.penalty.to_dict(),
                     "clusters": {c.cluster_id: c.stages for c in self.clusters.values()},
                     "ledger": self.ledger.to_dict() if self.ledger else None,
                     "version_stats": {str(v): list(x) for v, x in self._version_stats.items()},
                     "grace": self._window.state()}
        leader_step.save_state(self._run_dir / "leader.json", state)

    def event(self, kind: str, **extra: Any) -> None:
        """Append a timestamped event to ``leader_events.jsonl`` (and the log)."""
        log.info("%s %s", kind, extra)
        if self._run_dir is not None:
            with open(self._run_dir / "leader_events.jsonl", "a") as f:
                f.write(json.dumps({"time": time.time(), "event": kind, **extra}) + "\n")

    # ----- push / pull (called by cluster stage workers' client) ------------------------
    def request_push(self, cluster_id: str, base_version: int, tokens: int, timeout_s: float,
                     progress: dict[int, int] | None = None
                     ) -> tuple[Push, int, int, list[list[tuple[int, str, int]]]]:
        """Block until admitted into a grace window; returns (push, round, version, schedule).

        ``progress`` (chunk → window position reached) is recorded in the ledger. Raises
        ValueError on tokens <= 0, a negative base version or a progress report the ledger
        refuses; UnavailableError while followers are down or unreconciled; TimeoutError if
        not admitted in time.
        """
        if tokens <= 0:
            raise ValueError(f"push field 'tokens' = {tokens} must be > 0")
        if base_version < 0:
            raise ValueError(f"push field 'base_version' = {base_version} must be >= 0")
        with self._cond:
            cluster = self._member(cluster_id)
            if not self.ready:
                raise UnavailableError("followers not ready (down, missing or reconciling)")
            mine = self._round.pushes.get(cluster_id) if self._round else None
            if any(p.cluster_id == cluster_id for p in self._queue) or (
                    mine is not None and not mine.pulled):  # pulled: queue for the next round
                raise PreconditionError(f"cluster {cluster_id!r} already has a push in flight")
            if self.ledger is not None:
                self.ledger.report(cluster_id, progress or {})
            push = Push(cluster_id, secrets.token_hex(8), base_version, tokens)
            with contextlib.suppress(ValueError):  # λ of §7 (a clock that steps back is ignored)
                self._window.observe_request(self._clock())
            self._queue.append(push)
            self._cond.notify_all()
            deadline = self._clock() + timeout_s
            while not (self._round and self._round.pushes.get(cluster_id) is push):
                left = deadline - self._clock()
                if left <= 0 or self._stop.is_set() or push not in self._queue:
                    if push in self._queue:
                        self._queue.remove(push)
                    raise TimeoutError(f"cluster {cluster_id!r}: push not admitted in {timeout_s} s")
                self._cond.wait(min(left, 0.5))
            return (push, self._round.number, self.version,
                    self._schedule(self._round.number, cluster.stages))

    def _schedule(self, rnd: int, stages: list[list[str]]) -> list[list[tuple[int, str, int]]]:
        """One cluster's §10 schedule ``[[(stage, layer, follower), ...], ...]`` for round
        ``rnd``: layers in model order (the stages' order), followers least recently used
        across the clusters already scheduled in this round and the rounds before
        (:class:`dips.algo.ScheduleBook`); other clusters' schedules are left as they are."""
        names = [l for s in stages for l in s]
        index = {l: i for i, l in enumerate(names)}
        worker_layers = [[index[l] for l in s] for s in stages]
        owner = {index[l]: self._layer_owner[l] for l in names}
        steps = self._book.schedule(rnd, worker_layers, owner, max(self.followers) + 1)
        return [[(t.worker, names[t.layer], t.follower) for t in step] for step in steps]

    def push_done(self, cluster_id: str, push_id: str, ok: bool, error: str,
                  timeout_s: float) -> dict[str, Any]:
        """Report a push delivered (or failed); block until the round is decided.

        Returns the verdict: accepted, score, threshold, version to pull, round, clip factor,
        ledger holdings. Raises PreconditionError for an unknown push id, TimeoutError if
        undecided in time.
        """
        with self._cond:
            rnd = self._round
            push = rnd.pushes.get(cluster_id) if rnd else None
            if push is None or push.push_id != push_id:
                raise PreconditionError(f"push id {push_id!r} of cluster {cluster_id!r} is not "
                                        f"part of the current round")
            push.done, push.ok, push.error = True, ok, error
            self._cond.notify_all()
            deadline = self._clock() + timeout_s
            while push.verdict is None:
                left = deadline - self._clock()
                if left <= 0 or self._stop.is_set():
                    raise TimeoutError(f"round {rnd.number} undecided after {timeout_s} s")
                self._cond.wait(min(left, 0.5))
            return push.verdict

    def pull_done(self, cluster_id: str, version: int) -> None:
        """A cluster of the round pulled ``version`` (-1: it gave up; do not wait for it)."""
        with self._cond:
            c = self._member(cluster_id)
            if version >= 0:
                c.pulled_version = version
            if self._round and cluster_id in self._round.pushes:
                self._round.pushes[cluster_id].pulled = True
            self._cond.notify_all()

    # ----- the outer loop (§6) ----------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                reconcile = self.needs_reconcile and len(self.followers) == self.cfg.followers \
                    and all(f.up for f in self.followers.values())
                if not reconcile and not (self._queue and self.ready):
                    self._cond.wait(0.5)
                    continue
            if reconcile:
                self._reconcile()
                continue
            self._round_once()

    def _reconcile(self) -> None:
        try:
            target, lost = leader_step.reconcile(self)
        except Exception as exc:
            self.event("reconcile_failed", error=str(exc))
            self._stop.wait(1.0)
            return
        with self._cond:
            changed = target != self.version or lost
            self.version = target
            windows_lost = 0
            if lost:
                # The lost outer steps' updates and data no longer count: the ledger hands
                # their windows out again (§12; nothing lost, nothing counted twice).
                for v in [v for v in self._version_stats if v > target]:
                    n, tokens = self._version_stats.pop(v)
                    self.counts["updates_accepted"] -= n
                    self.counts["updates_lost"] = self.counts.get("updates_lost", 0) + n
                    self.counts["tokens_accepted"] -= tokens
                    self.counts["outer_steps"] -= 1
                if self.ledger is not None:
                    windows_lost = self.ledger.rollback(target)
            self.counts["outer_steps_lost"] += lost
            self.needs_reconcile = False
            self._cond.notify_all()
        self.event("reconciled", version=target, lost=lost, changed=bool(changed),
                   windows_lost=windows_lost)
        if lost:
            self._write({"event": "rollback", "version": target, "lost": lost, "time": time.time()})
        self.checkpoint()

    def decide(self, rnd: Round, new_version: int, accepted: list[str]) -> None:
        """Record a decided outer step (every follower prepared it) durably, before commits:
        version, counts and the ledger's accepted windows, then ``leader.json``."""
        with self._cond:
            self.version = new_version
            tokens = sum(rnd.pushes[c].tokens for c in accepted)
            self.counts["updates_accepted"] += len(accepted)
            self.counts["tokens_accepted"] += tokens
            self.counts["outer_steps"] += 1
            self._version_stats[new_version] = (len(accepted), tokens)
            for v in sorted(self._version_stats)[:-64]:
                del self._version_stats[v]
            if self.ledger is not None:
                for c in accepted:
                    if c in self.clusters:
                        self.ledger.resolve(c, True, new_version)
        self.checkpoint()

    def commit_failed(self, failed: list[int]) -> None:
        """Some follower did not commit: reconcile before the next round."""
        with self._cond:
            self.needs_reconcile = True
            for i in failed:
                self.followers[i].up = False

    def _round_once(self) -> None:
        with self._cond:
            now = self._clock()
            self.rounds += 1
            rnd = Round(self.rounds, now, self._window.close_time(now))
            self._round = rnd
            self.phase = "window"
            while True:
                for push in self._queue:
                    rnd.pushes[push.cluster_id] = push
                self._queue.clear()
                self._cond.notify_all()
                left = rnd.closes_at - self._clock()
                if left <= 0 or self._stop.is_set():
                    break
                self._cond.wait(left)
            self.phase = "push"
            failpoints.hit("push")
            push_deadline = self._clock() + self.cfg.push_timeout_s
            while not all(p.done for p in rnd.pushes.values()):
                left = push_deadline - self._clock()
                if left <= 0 or self._stop.is_set():
                    break
                self._cond.wait(min(left, 0.5))
            self.phase = "update"
            push_s = self._clock() - rnd.closes_at
        try:
            record = leader_step.outer_step(self, rnd)
        except Exception as exc:  # nothing was applied anywhere
            log.exception("round %d failed", rnd.number)
            record = {"round": rnd.number, "error": str(exc), "version": self.version,
                      "clusters": sorted(rnd.pushes), "accepted": []}
            with self._cond:
                self.needs_reconcile = True
        update_s = self._clock() - rnd.closes_at - push_s
        self._settle(rnd, record)
        failpoints.hit("pull")
        with self._cond:
            self.phase = "pull"
            self._cond.notify_all()
            pull_deadline = self._clock() + self.cfg.pull_timeout_s
            # With the pull barrier (the seed's §6 round) the next window waits for every pull;
            # without it the round's clusters pull their version from the followers' snapshots
            # while the next window already admits pushes, so a slow link delays only its own
            # cluster.
            while self.cfg.pull_barrier and not all(p.pulled or not p.ok
                                                    for p in rnd.pushes.values()):
                left = pull_deadline - self._clock()
                if left <= 0 or self._stop.is_set() or self.needs_reconcile:
                    break  # a follower is down: pulls cannot complete until it is back
                self._cond.wait(min(left, 0.5))
            pull_s = self._clock() - rnd.closes_at - push_s - update_s
            self._round = None
            self.phase = "idle"
            self._cond.notify_all()
        with self._cond:  # C_m of §7: what a request that missed this window waited for
            self._window.observe_round(max(update_s, 0.0), max(pull_s, 0.0))
            grace = self._window.stats()
        record.update(window_s=round(rnd.closes_at - rnd.opened_at, 4), push_s=round(push_s, 4),
                      update_s=round(update_s, 4), pull_s=round(pull_s, 4), grace=grace,
                      time=time.time())
        self._write(record)
        self.checkpoint()

    def _settle(self, rnd: Round, record: dict[str, Any]) -> None:
        """Counts, ledger and verdicts of a finished update phase; wakes the round's clusters."""
        accepted = set(record.get("accepted", []))
        pushes = rnd.pushes
        with self._cond:
            self.counts["updates_pushed"] += len(pushes)
            self.counts["updates_rejected"] += len(pushes) - len(accepted)
            self.counts["tokens_pushed"] += sum(p.tokens for p in pushes.values())
            invalid = record.get("invalid", {})
            for c, p in pushes.items():
                ok = c in accepted
                holdings = []
                if self.ledger is not None and c in self.clusters:
                    if not ok:  # accepted ones were resolved when the step was decided
                        self.ledger.resolve(c, False)
                    holdings = self.ledger.holdings(c)
                reason = "accepted" if ok else invalid.get(c, record.get("error") or
                                                           "penalty: score above threshold")
                p.verdict = {"accepted": ok, "score": record.get("scores", {}).get(c),
                             "threshold": record.get("threshold"), "version": self.version,
                             "round": rnd.number, "clip_factor": record.get("clip_factor") or 0.0,
                             "reason": reason, "holdings": holdings}
                if c in self.clusters:
                    self.clusters[c].last_push = "accepted" if ok else "rejected"
            self._cond.notify_all()

    def _write(self, record: dict[str, Any]) -> None:
        if self._run_dir is not None:
            with open(self._run_dir / "outer_steps.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    # ----- status ----------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        with self._cond:
            led = self.ledger.summary() if self.ledger else {"epoch": 0, "accepted_windows": 0}
            return {"version": self.version, "rounds": self.rounds, "phase": self.phase,
                    **self.counts, "clusters": [vars(c).copy() for c in self.clusters.values()],
                    "followers": list(self.followers.values()),
                    "followers_ready": sum(f.up for f in self.followers.values()),
                    "accepted_windows": led["accepted_windows"], "ledger_epoch": led["epoch"]}
