"""A follower parameter server: one shard of layers in FP32 with its Nesterov momentum (§5, §6, §8).

Data plane (ZeroMQ, :mod:`dips.wire.dataplane`):
  * ``push``: a stage worker's BF16 copy of one layer for (round, cluster); staged until the
    leader scores the round, and only if it carries the leader's admission ticket for that
    round, cluster and push id (nothing is allocated otherwise; replays are refused,
    :mod:`dips.roles.follower_admit`). Names, shapes, the wire dtype and the values are
    checked; a bad layer marks that cluster's push invalid on this shard, and the leader
    then excludes it on every shard.
  * ``pull``: the current θ of some owned layers as BF16 (FP32 on request, for export), refused unless the requested
    version is the shard's version (a pull never mixes versions).

Control (gRPC, called by the leader only): ``score`` (per-cluster ‖Δ‖² with Δ formed against
the current θ, §6), ``aggregate`` (token-weighted mean δ over the accepted set, returns
‖δ‖² on this shard, §8; usually ready from receipt, :mod:`dips.roles.round_sum`), then a
two-phase outer step: ``apply`` computes θ' = Nesterov(θ, clip·δ) in FP32 aside (in place in
spare buffers refreshed after every commit, :mod:`dips.roles.spare`), ``commit`` makes it
current (version += 1) or ``abort`` drops it;
``restore`` brings the shard to a given version (commit it if prepared, else load it from
its checkpoint) when the leader reconciles followers after a failure (§12); ``discard``.
The follower never decides membership or acceptance: it applies exactly the accepted set and
clip factor the leader sends, and records each applied outer step in ``applied.jsonl``.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from dips.algo import pseudo_gradient, squared_norm, weighted_mean
from dips.algo.outer import nesterov_step_fused, round_state_
from dips.roles import failpoints
from dips.roles.follower_admit import Admission, last_round
from dips.roles.follower_data import DataPlaneSide, StagedPush
from dips.roles.follower_restore import ShardRecovery
from dips.roles.round_sum import RoundSum
from dips.roles.shard_checksum import shard_checksum
from dips.roles.spare import SpareState
from dips.roles.staging import delta_sq


@dataclass
class _RoundMean:
    """δ of a round as aggregated: the accepted set, its weights, δ (or S with ``scale``)."""

    clusters: list[str]
    weights: list[float]
    mean: list[torch.Tensor]
    scale: float


@dataclass
class _PreparedStep:
    """Phase 1 of a two-phase outer step: θ' and its momentum, formed aside (§12)."""

    round: int
    version: int
    params: dict[str, torch.Tensor]
    momenta: dict[str, torch.Tensor]
    checksum: str
    accepted: list[str]
    weights: list[float]
    clip_factor: float


class FollowerShard(DataPlaneSide, ShardRecovery):
    """State machine of one follower.

    Args:
        index: follower index (0..M-1).
        layers: ordered ``{layer key: [param names]}`` this follower owns.
        params: ``{param name: FP32 tensor}`` for every owned parameter (version ``version``).
        outer_lr, outer_momentum: Nesterov hyper-parameters (§13: 0.7, 0.8).
        state_dtype: "fp32" (§12) or "bf16": θ and momentum rounded to BF16 after each outer
            step (``OuterConfig.state_dtype``, :func:`dips.algo.outer.round_state_`).
        log_dir: directory for ``applied.jsonl`` and the admitted push ids
            (:class:`~dips.roles.follower_admit.PushIds`; None: neither).
        version: version of ``params``.
        momenta: Nesterov momentum of that version (None: zeros, a fresh run).
        ckpt_dir: where shard checkpoints go (None: no checkpoints); version ``version`` is
            checkpointed at once if it is not already on disk.
        keep: complete checkpoints kept (>= 2).
        wire_dtype: the run's wire dtype ("bf16" | "fp32"): pushed tensors of another dtype
            are refused. None: either (trusted in-process callers).
        require_tickets: refuse every push without a valid admission ticket, and every push
            until :meth:`set_admission_key` (a follower process). False: tickets are checked
            once a key is set (:mod:`dips.roles.follower_admit`).
        on_checkpoint: called with (version, seconds) after each checkpoint written
            (:class:`dips.roles.checkpoint.CheckpointWriter`'s ``on_saved``).

    Raises:
        ValueError: a parameter is missing or not FP32, or an unknown wire dtype.
    """

    def __init__(self, index: int, layers: dict[str, list[str]], params: dict[str, torch.Tensor],
                 outer_lr: float = 0.7, outer_momentum: float = 0.8,
                 log_dir: Path | None = None, version: int = 0,
                 momenta: dict[str, torch.Tensor] | None = None,
                 ckpt_dir: Path | None = None, keep: int = 3, state_dtype: str = "fp32",
                 wire_dtype: str | None = None, require_tickets: bool = False,
                 on_checkpoint: Callable[[int, float], None] | None = None) -> None:
        round_state_([], state_dtype)  # refuses an unknown precision before any state exists
        if wire_dtype not in (None, "bf16", "fp32"):
            raise ValueError(f"wire_dtype = {wire_dtype!r} is not 'bf16' or 'fp32'")
        for layer, names in layers.items():
            for n in names:
                if n not in params:
                    raise ValueError(f"layer {layer!r}: parameter {n!r} missing from shard")
                if params[n].dtype != torch.float32:
                    raise ValueError(f"parameter {n!r}: dtype {params[n].dtype}, expected FP32")
        self.index = index
        self.layers = layers
        self.names = [n for names in layers.values() for n in names]
        self.params = {n: params[n].contiguous().clone() for n in self.names}
        self.momenta = {n: (momenta[n].contiguous().clone() if momenta else
                            torch.zeros_like(self.params[n])) for n in self.names}
        self.version = version
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.state_dtype = state_dtype
        self.wire_dtype = wire_dtype
        self._staged: dict[tuple[int, str], StagedPush] = {}
        self._rounds_seen: set[int] = set()  # for the window/push failpoints
        # Pushes sent ahead of their round (a slow link), by push id: (cluster, T_j, layers).
        self._early: dict[str, tuple[str, Any, StagedPush]] = {}
        self._deltas: dict[int, dict[str, list[torch.Tensor]]] = {}
        self._sq: dict[int, dict[str, float]] = {}
        self._sums: dict[int, RoundSum] = {}
        self._mean: dict[int, _RoundMean] = {}
        self._prepared: _PreparedStep | None = None
        self._spare = SpareState()
        self._ckpt_dir = ckpt_dir
        self._writer = None
        self.checksum = shard_checksum(self.params)  # of the current version, kept up to date
        if ckpt_dir is not None:
            from dips.roles.checkpoint import CheckpointWriter

            self._writer = CheckpointWriter(ckpt_dir, index, keep, on_saved=on_checkpoint)
            if self._writer.written < version:
                self._writer.submit(version, self.params, self.momenta, self.checksum,
                                    copy=False)
        self._spare.refresh(version, self.params, self.momenta)
        self._lock = threading.RLock()
        self._log = (log_dir / "applied.jsonl") if log_dir else None
        #: ``(cluster, round) -> connections that pushed`` (the data server's
        #: ``push_connections``); when set, each applied record carries ``connections``.
        self.push_connections: Callable[[str, int], int] | None = None
        #: Busy time since the last record (``BusyTime.take``); when set, each applied record
        #: carries its ``busy_s`` by phase and ``span_s`` (seconds).
        self.busy: Callable[[], dict[str, Any]] | None = None
        # A restarted follower keeps refusing pushes of the rounds it applied before.
        self._admission = Admission(require_tickets, closed=last_round(self._log),
                                    state_dir=log_dir)
        if log_dir:
            log_dir.mkdir(parents=True, exist_ok=True)
            if self._log.exists() and self._log.stat().st_size:
                # A restarted process resumes from its newest complete checkpoint, which may be
                # older than the last step it logged (killed before the asynchronous write):
                # the log says so, as a restore does (found by the fault tests).
                self._record({"event": "restore", "version": version, "checksum": self.checksum,
                              "cause": "process start"})

    # ----- data plane -------------------------------------------------------------------
    def score(self, rnd: int, clusters: list[str], push_ids: list[str] | None = None,
              retired: list[str] | None = None) -> list[tuple[str, bool, float, str]]:
        """Per cluster: (id, valid, ‖Δ‖² on this shard, error). Δ = θ_now − θ_cluster (§6).

        ``push_ids`` (same order as ``clusters``) name pushes sent ahead of this round: they
        are taken into the round here and their Δ formed now, against the current θ.
        ``retired`` names the round's pushes the leader decided as not delivered (not scored):
        what was staged of them ahead of their round is dropped. Every push id named in
        either is decided by the leader from now on: its chunks arriving later are refused
        STALE_GRANT, staged here or not (review 25, M2).
        """
        out = []
        with self._lock:
            for pid in retired or []:
                self._admission.retire(pid)
                self._early.pop(pid, None)  # its Δ buffers go back, an open stream is revoked
            for c, pid in zip(clusters, push_ids or []):
                if pid:
                    self._admission.retire(pid)  # decided: its chunks sent later are stale
                if (rnd, c) not in self._staged and pid in self._early and self._early[pid][0] == c:
                    _, tokens, staged = self._early.pop(pid)
                    self._staged[(rnd, c)] = staged
                    try:
                        self._round_sum(rnd).announce(c, tokens)
                    except ValueError as exc:
                        staged.error = staged.error or str(exc)
            deltas = self._deltas.setdefault(rnd, {})
            for c in clusters:
                staged = self._staged.get((rnd, c))
                got = (set(staged.layers) | staged.done) if staged else set()
                if staged is None or staged.error or got != set(self.layers):
                    missing = sorted(set(self.layers) - got) if staged else "all"
                    err = staged.error if staged and staged.error else f"layers missing: {missing}"
                    out.append((c, False, 0.0, err))
                    continue
                try:
                    deltas[c], total = self._scored(rnd, c, staged)
                except ValueError as exc:  # a value too large to score: the push is invalid
                    staged.error = str(exc)
                    out.append((c, False, 0.0, staged.error))
                    continue
                self._sq.setdefault(rnd, {})[c] = total
                out.append((c, True, total, ""))
        return out

    def _scored(self, rnd: int, c: str, staged: StagedPush) -> tuple[list[torch.Tensor], float]:
        """(Δ per tensor, ‖Δ‖² on this shard) of a complete push (lock held). Layers kept as
        sent (pushed ahead of their round) get their Δ formed now, checked as at receipt.
        Raises ValueError (:func:`dips.roles.staging.delta_sq`) for a value too large."""
        d, total = [], 0.0
        for l, names in self.layers.items():
            if l not in staged.done and any(n not in staged.formed for n in names):
                # kept as sent: Δ formed now, then counted in the round's sum
                for n in names:
                    staged.formed[n] = pseudo_gradient(self.params[n], staged.layers[l][n])
                    staged.sq[n] = delta_sq(n, staged.formed[n])
                self._round_sum(rnd).layer_done(c, names, self._delta_of(rnd))
            for n in names:
                d.append(staged.delta[n] if l in staged.done else staged.formed[n])
                total += staged.sq[n]  # per-tensor sums in one order: paths bit-identical
        return d, total

    def aggregate(self, rnd: int, clusters: list[str], weights: list[float]) -> float:
        """Form δ = Σ w_j Δ_j over ``clusters`` (already scored); return ‖δ‖² on this shard.

        Usually nothing is left to compute here: one accepted cluster's δ is its Δ (weight 1)
        with ‖Δ‖² from receipt, and several clusters' δ is the round's sum S/ΣT formed at
        receipt (:mod:`dips.roles.round_sum`). Otherwise δ is formed now. Raises ValueError if
        the lengths differ or a cluster was not scored on this shard.
        """
        if len(clusters) != len(weights) or not clusters:
            raise ValueError(f"aggregate: {len(clusters)} clusters but {len(weights)} weights")
        with self._lock:
            deltas = self._deltas.get(rnd, {})
            missing = [c for c in clusters if c not in deltas]
            if missing:
                raise ValueError(f"aggregate round {rnd}: clusters {missing} were not scored here")
            if len(clusters) == 1 and weights[0] == 1.0:
                mean, scale, sq = deltas[clusters[0]], 1.0, self._sq[rnd][clusters[0]]
            elif rnd in self._sums and (ready := self._sums[rnd].mean(clusters, weights,
                                                                      self.names)) is not None:
                mean, scale, sq = ready
            else:
                mean = weighted_mean([deltas[c] for c in clusters], list(weights))
                scale, sq = 1.0, squared_norm(mean)
            self._mean[rnd] = _RoundMean(list(clusters), list(weights), mean, scale)
            return sq

    def apply(self, rnd: int, clip: float, new_version: int, accepted: list[str],
              weights: list[float]) -> tuple[int, str]:
        """Phase 1 of the outer step of ``rnd``: compute θ' = Nesterov(θ, clip·δ) aside.

        Nothing visible changes until :meth:`commit` (phase 2); :meth:`abort` drops it. This is
        what makes an outer step that a follower failure interrupts applied by all followers
        or by none. Idempotent for the same round. Returns (new_version, checksum of θ').
        Raises ValueError if the version does not follow, the accepted set/weights differ from
        those aggregated, or the clip factor is not in (0, 1].
        """
        with self._lock:
            if self._prepared is not None and self._prepared.round == rnd:
                return self._prepared.version, self._prepared.checksum
            if new_version != self.version + 1:
                raise ValueError(f"apply field 'new_version' = {new_version}, shard is at "
                                 f"version {self.version}")
            if rnd not in self._mean:
                raise ValueError(f"apply round {rnd}: nothing aggregated")
            m = self._mean[rnd]
            clusters, w, mean, scale = m.clusters, m.weights, m.mean, m.scale
            if clusters != list(accepted) or [round(x, 12) for x in w] != [round(x, 12) for x in weights]:
                raise ValueError(f"apply round {rnd}: accepted {accepted} differs from "
                                 f"aggregated {clusters}")
            if not (0.0 < clip <= 1.0):
                raise ValueError(f"apply field 'clip_factor' = {clip} not in (0, 1]")
            # θ' and its momentum are formed in place in the spare buffers, which already hold
            # a copy of the current version (refreshed in the background after the last commit);
            # commit swaps them in.
            params, momenta = self._spare.take(self.version, self.params, self.momenta)
            try:
                nesterov_step_fused([params[n] for n in self.names],
                                    [momenta[n] for n in self.names], mean, self.outer_lr,
                                    self.outer_momentum, scale=clip * scale)
                round_state_([params[n] for n in self.names] + [momenta[n] for n in self.names],
                             self.state_dtype)
            except BaseException:
                self._spare.recycle(params, momenta)
                raise
            checksum = shard_checksum(params)
            failpoints.hit("update")
            self._prepared = _PreparedStep(rnd, new_version, params, momenta, checksum,
                                           list(accepted), list(weights), clip)
            return new_version, checksum

    def commit(self, new_version: int, timeout_s: float = 60.0) -> tuple[int, str]:
        """Phase 2: make the prepared version current, log it, checkpoint it asynchronously.

        Idempotent: committing the current version again returns it. Before replacing θ it
        waits until the current version's checkpoint is durable, so a rollback target always
        exists on disk. Raises ValueError if no such version is prepared, TimeoutError if the
        previous checkpoint does not complete within ``timeout_s``.
        """
        with self._lock:
            if self._prepared is None and new_version == self.version:
                return self.version, self.checksum
            prep = self._prepared
            if prep is None or prep.version != new_version:
                have = None if prep is None else prep.version
                raise ValueError(f"commit field 'new_version' = {new_version}, prepared {have}")
            if self._writer is not None and not self._writer.wait(self.version, timeout_s):
                raise TimeoutError(f"checkpoint of version {self.version} not durable in {timeout_s} s")
            if getattr(self, "_pools", None) is not None:  # slow pullers keep their version
                self._pools[1].complete(self.version, lambda n: self.params[n])
            self._spare.recycle(self.params, self.momenta)
            self.params, self.momenta = prep.params, prep.momenta
            self.version, self.checksum = new_version, prep.checksum
            self._prepared = None
            self._drop(prep.round)
            rec = {"version": self.version, "round": prep.round, "accepted": prep.accepted,
                   "weights": prep.weights, "clip_factor": prep.clip_factor,
                   "checksum": prep.checksum}
            if self.push_connections is not None:  # per accepted cluster (§5: its stages)
                rec["connections"] = {c: self.push_connections(c, prep.round)
                                      for c in prep.accepted}
            if self.busy is not None:  # utilisation since the last record (dips report)
                rec.update(self.busy())
            self._record(rec)
            if self._writer is not None:
                # No copy: the committed tensors are not modified until they are recycled as
                # spare buffers, which the next commit does only once this write is durable.
                self._writer.submit(self.version, self.params, self.momenta, prep.checksum,
                                    copy=False)
            self._spare.refresh(self.version, self.params, self.momenta)
            return self.version, prep.checksum

    def abort(self, rnd: int | None) -> None:
        """Drop a prepared (uncommitted) outer step and everything staged up to round ``rnd``
        (None: whatever its round)."""
        with self._lock:
            if self._prepared is not None and (rnd is None or self._prepared.round <= rnd):
                self._drop_prepared()
            self._drop(rnd)

    def _drop_prepared(self) -> None:
        # The prepared buffers were stepped in place: recycle them and copy the current version.
        self._spare.recycle(self._prepared.params, self._prepared.momenta)
        self._prepared = None
        self._spare.refresh(self.version, self.params, self.momenta)

    def _record(self, rec: dict[str, Any]) -> None:
        if self._log:
            with open(self._log, "a") as f:
                f.write(json.dumps({**rec, "follower": self.index, "time": time.time()}) + "\n")

    def discard(self, rnd: int) -> None:
        """Drop everything staged for rounds <= ``rnd`` (a round with nothing accepted)."""
        with self._lock:
            self._drop(rnd)

    def _drop(self, rnd: int | None) -> None:
        """Forget what was staged for rounds <= ``rnd`` (None: every round); rounds <= ``rnd``
        are closed: a push for one of them from now on is a replay (STALE_GRANT)."""
        def old(r: int) -> bool:
            return rnd is None or r <= rnd

        if rnd is not None:
            self._admission.close(rnd)
        for key in [k for k in self._staged if old(k[0])]:
            del self._staged[key]
        for r in [r for r in self._sums if old(r)]:
            self._sums.pop(r).close()
        for d in (self._deltas, self._mean, self._sq):
            for r in [r for r in d if old(r)]:
                del d[r]

    def state(self) -> tuple[int, int, str]:
        """(index, version, checksum of the shard)."""
        with self._lock:
            return self.index, self.version, self.checksum

    @property
    def prepared_version(self) -> int:
        """Version prepared by :meth:`apply` and not yet committed, or -1."""
        with self._lock:
            return -1 if self._prepared is None else self._prepared.version

    def close(self) -> None:
        """Finish the pending checkpoint write."""
        if self._writer is not None:
            self._writer.close()
