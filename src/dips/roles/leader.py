"""The leader: control plane of Di-PS (§5, §6, §8 of the seed). Metadata only.

The outer loop of §6 as a state machine with phases ``idle → window → push → update → pull``:

* ``idle``: no request pending; the loop waits without timeout (the server never updates
  with nothing to do).
* ``window``: the first push request opens the grace window; every request that arrives
  before it closes joins the same outer step (round). Each admitted cluster receives a
  push id and a §10 communication schedule for its stage workers.
* ``push``: the window has closed; the leader waits until every admitted cluster has
  reported its push done (or the push timeout passes; a late push is then dropped).
  Requests arriving from here on queue for the next round; their clusters wait, others train.
* ``update``: followers report per-cluster ‖Δ‖² on their shards; the leader sums them,
  runs the penalty (§8), computes token weights over the accepted set, sums the followers'
  ‖δ‖², sends one clip factor min(1, c/‖δ‖₂) and the new version to every follower.
* ``pull``: every cluster of the round is told the version to pull (accepted or not); the
  next round opens when all have pulled or the pull timeout passes.

Tensors never pass through the leader: it only calls the followers' control service.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from dips.algo import (FixedGraceWindow, PenaltyConfig, PenaltyState, clip_factor, decide,
                       greedy_schedule, token_weights)
from dips.wire.control import PreconditionError

log = logging.getLogger(__name__)


class FollowerControl(Protocol):
    """What the leader needs from a follower (implemented over gRPC by the roles' caller)."""

    def score(self, rnd: int, clusters: list[str]) -> list[tuple[str, bool, float, str]]: ...
    def aggregate(self, rnd: int, clusters: list[str], weights: list[float]) -> float: ...
    def apply(self, rnd: int, clip: float, new_version: int, accepted: list[str],
              weights: list[float]) -> tuple[int, str]: ...
    def discard(self, rnd: int) -> None: ...


@dataclass
class FollowerEntry:
    index: int
    data_endpoint: str
    control_endpoint: str
    layers: list[str]
    layer_bytes: list[int]
    control: FollowerControl | None = None


@dataclass
class ClusterEntry:
    cluster_id: str
    stages: list[list[str]]
    inner_step: int = 0
    tokens: int = 0
    last_loss: float = float("nan")
    last_push: str = "-"
    pulled_version: int = -1
    last_seen: float = 0.0


@dataclass
class Push:
    """One admitted push request of a round."""

    cluster_id: str
    push_id: str
    base_version: int
    tokens: int
    done: bool = False
    ok: bool = False
    error: str = ""
    pulled: bool = False
    verdict: dict[str, Any] | None = None


@dataclass
class Round:
    number: int
    opened_at: float
    closes_at: float
    pushes: dict[str, Push] = field(default_factory=dict)


@dataclass(frozen=True)
class LeaderConfig:
    """Leader settings. Times in seconds.

    Attributes:
        grace_window_s: fixed grace window length (§6, §7).
        push_timeout_s: after the window closes, how long to wait for admitted pushes.
        pull_timeout_s: how long to wait for the round's clusters to pull.
        max_norm: global clip threshold c (§8; None disables clipping, an ablation).
        uniform_weights: ablation: 1/n instead of token weights.
        penalty: §8 settings (α, β, warm-up).
    """

    grace_window_s: float = 1.0
    push_timeout_s: float = 60.0
    pull_timeout_s: float = 60.0
    max_norm: float | None = 1.0
    uniform_weights: bool = False
    heartbeat_interval_s: float = 1.0
    penalty: PenaltyConfig = field(default_factory=PenaltyConfig)


class Leader:
    """The leader's state machine; gRPC handlers call its public methods from many threads.

    Args:
        cfg: :class:`LeaderConfig`.
        connect: ``FollowerEntry -> FollowerControl``, how to reach a registered follower.
        run_dir: where ``outer_steps.jsonl`` goes (None: not written).
        clock: wall clock in seconds (injectable for tests).
    """

    def __init__(self, cfg: LeaderConfig, connect: Callable[[FollowerEntry], FollowerControl],
                 run_dir: Path | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self._connect = connect
        self._clock = clock
        self._window = FixedGraceWindow(cfg.grace_window_s)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.followers: dict[int, FollowerEntry] = {}
        self.clusters: dict[str, ClusterEntry] = {}
        self.version = 0
        self.rounds = 0
        self.phase = "idle"
        self.penalty = PenaltyState()
        self.counts = {"updates_pushed": 0, "updates_accepted": 0, "updates_rejected": 0,
                       "tokens_pushed": 0, "tokens_accepted": 0, "outer_steps": 0}
        self._queue: list[Push] = []
        self._round: Round | None = None
        self._layer_owner: dict[str, int] = {}
        self._log_path = (run_dir / "outer_steps.jsonl") if run_dir else None
        self._thread = threading.Thread(target=self._loop, name="leader-loop", daemon=True)

    # ----- lifecycle -------------------------------------------------------------------
    def start(self) -> "Leader":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout_s)

    # ----- membership ------------------------------------------------------------------
    def register_follower(self, entry: FollowerEntry) -> None:
        """Add (or replace) follower ``entry.index``. Raises ValueError on overlapping layers."""
        with self._cond:
            for f in self.followers.values():
                if f.index != entry.index and set(f.layers) & set(entry.layers):
                    raise ValueError(f"follower {entry.index}: layers "
                                     f"{sorted(set(f.layers) & set(entry.layers))} already owned "
                                     f"by follower {f.index}")
            entry.control = self._connect(entry)
            self.followers[entry.index] = entry
            self._layer_owner = {l: f.index for f in self.followers.values() for l in f.layers}
            self._cond.notify_all()

    def join_cluster(self, cluster_id: str, stages: list[list[str]]) -> tuple[int, list[FollowerEntry]]:
        """Admit a cluster whose stage workers own ``stages`` (layer keys).

        Returns the current version and the followers to pull from. Raises ValueError if the
        stages do not cover every layer of the model exactly once, or the id is empty.
        """
        if not cluster_id:
            raise ValueError("join field 'cluster_id' is empty")
        with self._cond:
            flat = [l for s in stages for l in s]
            if sorted(flat) != sorted(self._layer_owner) or len(flat) != len(set(flat)):
                raise ValueError(f"cluster {cluster_id!r}: stage layers {flat} do not cover the "
                                 f"model's layers {sorted(self._layer_owner)} exactly once")
            entry = self.clusters.get(cluster_id) or ClusterEntry(cluster_id, stages)
            entry.stages = stages
            entry.last_seen = self._clock()
            self.clusters[cluster_id] = entry
            return self.version, list(self.followers.values())

    def heartbeat(self, cluster_id: str, inner_step: int, tokens: int, loss: float) -> int:
        """Record a cluster's progress (metadata); returns the current version."""
        with self._cond:
            c = self._cluster(cluster_id)
            c.inner_step, c.tokens, c.last_loss, c.last_seen = inner_step, tokens, loss, self._clock()
            return self.version

    def leave(self, cluster_id: str) -> None:
        """Remove a cluster. A push it has in the current round counts as failed (if not yet
        delivered) and the round stops waiting for its pull; a queued request is dropped."""
        with self._cond:
            self.clusters.pop(cluster_id, None)
            self._queue = [p for p in self._queue if p.cluster_id != cluster_id]
            push = self._round.pushes.get(cluster_id) if self._round else None
            if push is not None:
                if not push.done:
                    push.done, push.ok, push.error = True, False, "cluster left"
                push.pulled = True
            self._cond.notify_all()

    def _cluster(self, cluster_id: str) -> ClusterEntry:
        if cluster_id not in self.clusters:
            raise PreconditionError(f"cluster {cluster_id!r} has not joined")
        return self.clusters[cluster_id]

    # ----- push / pull (called by cluster stage workers' client) ------------------------
    def request_push(self, cluster_id: str, base_version: int, tokens: int,
                     timeout_s: float) -> tuple[Push, int, int, list[list[tuple[int, str, int]]]]:
        """Block until admitted into a grace window; returns (push, round, version, schedule).

        The schedule is a list of steps of (stage, layer, follower). Raises ValueError on
        tokens <= 0 or a base version from the future, TimeoutError if not admitted in time.
        """
        if tokens <= 0:
            raise ValueError(f"push field 'tokens' = {tokens} must be > 0")
        with self._cond:
            cluster = self._cluster(cluster_id)
            if base_version > self.version or base_version < 0:
                raise ValueError(f"push field 'base_version' = {base_version}; leader is at "
                                 f"version {self.version}")
            if any(p.cluster_id == cluster_id for p in self._queue) or (
                    self._round and cluster_id in self._round.pushes):
                raise PreconditionError(f"cluster {cluster_id!r} already has a push in flight")
            push = Push(cluster_id, secrets.token_hex(8), base_version, tokens)
            self._queue.append(push)
            self._cond.notify_all()
            deadline = self._clock() + timeout_s
            while not (self._round and self._round.pushes.get(cluster_id) is push):
                left = deadline - self._clock()
                if left <= 0 or self._stop.is_set():
                    if push in self._queue:
                        self._queue.remove(push)
                    raise TimeoutError(f"cluster {cluster_id!r}: push not admitted in {timeout_s} s")
                self._cond.wait(min(left, 0.5))
            return push, self._round.number, self.version, self._schedule(cluster.stages)

    def _schedule(self, stages: list[list[str]]) -> list[list[tuple[int, str, int]]]:
        names = sorted(self._layer_owner, key=lambda l: (self._layer_owner[l], l))
        index = {l: i for i, l in enumerate(names)}
        worker_layers = [[index[l] for l in s] for s in stages]
        owner = {index[l]: self._layer_owner[l] for l in names}
        steps = greedy_schedule(worker_layers, owner, max(self.followers) + 1)
        return [[(t.worker, names[t.layer], t.follower) for t in step] for step in steps]

    def push_done(self, cluster_id: str, push_id: str, ok: bool, error: str,
                  timeout_s: float) -> dict[str, Any]:
        """Report a push delivered (or failed); block until the round is decided.

        Returns the verdict: accepted, score, threshold, version to pull, round, clip factor.
        Raises PreconditionError for an unknown push id, TimeoutError if undecided in time.
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
        with self._cond:
            c = self._cluster(cluster_id)
            c.pulled_version = version
            if self._round and cluster_id in self._round.pushes:
                self._round.pushes[cluster_id].pulled = True
            self._cond.notify_all()

    # ----- the outer loop (§6) ----------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                if not self._queue:
                    self._cond.wait(0.5)
                    continue
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
                push_deadline = self._clock() + self.cfg.push_timeout_s
                while not all(p.done for p in rnd.pushes.values()):
                    left = push_deadline - self._clock()
                    if left <= 0 or self._stop.is_set():
                        break
                    self._cond.wait(min(left, 0.5))
                self.phase = "update"
                push_s = self._clock() - rnd.closes_at
            try:
                record = self._outer_step(rnd)
            except Exception as exc:  # a failed step changes nothing at the leader
                log.exception("round %d failed", rnd.number)
                record = {"round": rnd.number, "error": str(exc), "version": self.version}
                for p in rnd.pushes.values():
                    p.verdict = p.verdict or {"accepted": False, "version": self.version,
                                              "round": rnd.number, "reason": f"round failed: {exc}"}
            update_s = self._clock() - rnd.closes_at - push_s
            with self._cond:
                self.phase = "pull"
                self._cond.notify_all()
                pull_deadline = self._clock() + self.cfg.pull_timeout_s
                while not all(p.pulled or not p.done for p in rnd.pushes.values()):
                    left = pull_deadline - self._clock()
                    if left <= 0 or self._stop.is_set():
                        break
                    self._cond.wait(min(left, 0.5))
                pull_s = self._clock() - rnd.closes_at - push_s - update_s
                self._round = None
                self.phase = "idle"
                self._cond.notify_all()
            record.update(window_s=round(rnd.closes_at - rnd.opened_at, 4), push_s=round(push_s, 4),
                          update_s=round(update_s, 4), pull_s=round(pull_s, 4), time=time.time())
            self._write(record)

    def _outer_step(self, rnd: Round) -> dict[str, Any]:
        """Score, decide, aggregate, clip and apply one round. Runs without the lock held."""
        pushes = rnd.pushes
        delivered = sorted(c for c, p in pushes.items() if p.done and p.ok)
        invalid: dict[str, str] = {c: (p.error or "push not delivered in time")
                                   for c, p in pushes.items() if c not in delivered}
        followers = [self.followers[i] for i in sorted(self.followers)]
        norms = {c: 0.0 for c in delivered}
        for f in followers:
            for c, valid, sq, err in f.control.score(rnd.number, delivered):
                if not valid:
                    invalid.setdefault(c, f"follower {f.index}: {err}")
                norms[c] += sq
        scored = {c: g for c, g in norms.items() if c not in invalid}
        accepted: list[str] = []
        scores: dict[str, float | None] = {}
        threshold = None
        if scored:
            verdict, self.penalty = decide(self.penalty, scored, self.cfg.penalty)
            accepted, scores, threshold = verdict.accepted, dict(verdict.scores), verdict.threshold
        tokens = {c: pushes[c].tokens for c in accepted}
        weights: dict[str, float] = {}
        clip, sq_norm, checksums = None, None, {}
        if accepted:
            weights = token_weights(tokens, accepted, uniform=self.cfg.uniform_weights)
            w = [weights[c] for c in accepted]
            sq_norm = sum(f.control.aggregate(rnd.number, accepted, w) for f in followers)
            clip = clip_factor(sq_norm, self.cfg.max_norm if self.cfg.max_norm else float("inf"))
            new_version = self.version + 1
            for f in followers:
                version, checksums[f.index] = f.control.apply(rnd.number, clip, new_version,
                                                              accepted, w)
            self.version = new_version
        else:
            for f in followers:
                f.control.discard(rnd.number)
        with self._cond:
            self.counts["updates_pushed"] += len(pushes)
            self.counts["updates_accepted"] += len(accepted)
            self.counts["updates_rejected"] += len(pushes) - len(accepted)
            self.counts["tokens_pushed"] += sum(p.tokens for p in pushes.values())
            self.counts["tokens_accepted"] += sum(tokens.values())
            self.counts["outer_steps"] += 1 if accepted else 0
            for c, p in pushes.items():
                ok = c in accepted
                reason = "accepted" if ok else invalid.get(c, "penalty: score above threshold")
                p.verdict = {"accepted": ok, "score": scores.get(c), "threshold": threshold,
                             "version": self.version, "round": rnd.number,
                             "clip_factor": clip or 0.0, "reason": reason}
                if c in self.clusters:
                    self.clusters[c].last_push = "accepted" if ok else "rejected"
            self._cond.notify_all()
        return {"round": rnd.number, "version": self.version, "clusters": sorted(pushes),
                "accepted": accepted,
                "rejected": {c: {"score": scores.get(c), "reason": invalid.get(c, "penalty")}
                             for c in sorted(pushes) if c not in accepted},
                "scores": scores, "threshold": threshold,
                "sq_norms": {c: norms.get(c) for c in sorted(pushes)},
                "tokens": {c: p.tokens for c, p in pushes.items()},
                "base_versions": {c: p.base_version for c, p in pushes.items()},
                "weights": weights, "delta_sq_norm": sq_norm, "clip_factor": clip,
                "checksums": checksums}

    def _write(self, record: dict[str, Any]) -> None:
        if self._log_path:
            with open(self._log_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    # ----- status ----------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        with self._cond:
            return {"version": self.version, "rounds": self.rounds, "phase": self.phase,
                    **self.counts, "clusters": [vars(c).copy() for c in self.clusters.values()],
                    "followers": list(self.followers.values())}
