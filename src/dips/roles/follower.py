"""A follower parameter server: one shard of layers in FP32 with its Nesterov momentum (§5, §6, §8).

Data plane (ZeroMQ, :mod:`dips.wire.dataplane`):
  * ``push``: a stage worker's BF16 copy of one layer for (round, cluster); staged until the
    leader scores the round. Names, shapes and finiteness are checked; a bad layer marks that
    cluster's push invalid on this shard, and the leader then excludes it on every shard.
  * ``pull``: the current θ of some owned layers as BF16 (FP32 on request, for export), refused unless the requested
    version is the shard's version (a pull never mixes versions).

Control (gRPC, called by the leader only): ``score`` (per-cluster ‖Δ‖² with Δ formed against
the current θ, §6), ``aggregate`` (token-weighted mean δ over the accepted set, returns
‖δ‖² on this shard, §8), ``apply`` (clip factor + Nesterov in FP32, version += 1), ``discard``.
The follower never decides membership or acceptance: it applies exactly the accepted set and
clip factor the leader sends, and records each applied outer step in ``applied.jsonl``.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from dips.algo import nesterov_step, pseudo_gradient, squared_norm, weighted_mean
from dips.wire.frames import Message


@dataclass
class _StagedPush:
    """BF16 layers one cluster sent for one round; ``error`` set if any layer was refused."""

    layers: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    error: str | None = None


def shard_checksum(params: dict[str, torch.Tensor]) -> str:
    """SHA-256 (first 16 hex digits) of the FP32 bytes of ``params`` in name order."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class FollowerShard:
    """State machine of one follower.

    Args:
        index: follower index (0..M-1).
        layers: ordered ``{layer key: [param names]}`` this follower owns.
        params: ``{param name: FP32 tensor}`` for every owned parameter (version ``version``).
        outer_lr, outer_momentum: Nesterov hyper-parameters (§13: 0.7, 0.8).
        log_dir: directory for ``applied.jsonl`` (None: no log).
        version: version of ``params``.

    Raises:
        ValueError: a parameter is missing or not FP32.
    """

    def __init__(self, index: int, layers: dict[str, list[str]], params: dict[str, torch.Tensor],
                 outer_lr: float = 0.7, outer_momentum: float = 0.8,
                 log_dir: Path | None = None, version: int = 0) -> None:
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
        self.momenta = {n: torch.zeros_like(self.params[n]) for n in self.names}
        self.version = version
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self._staged: dict[tuple[int, str], _StagedPush] = {}
        self._deltas: dict[int, dict[str, list[torch.Tensor]]] = {}
        self._mean: dict[int, tuple[list[str], list[float], list[torch.Tensor]]] = {}
        self._applied_rounds: dict[int, tuple[int, str]] = {}
        self._lock = threading.RLock()
        self._log = (log_dir / "applied.jsonl") if log_dir else None
        if log_dir:
            log_dir.mkdir(parents=True, exist_ok=True)

    # ----- data plane -------------------------------------------------------------------
    def handle(self, msg: Message) -> tuple[dict[str, Any], Sequence[tuple[str, torch.Tensor]]]:
        """Serve one data-plane message (see module docstring). Raises ValueError if malformed."""
        op = msg.header.get("op")
        if op == "push":
            return self._receive_push(msg), ()
        if op == "pull":
            return self._serve_pull(msg)
        raise ValueError(f"header field 'op' = {op!r} is not 'push' or 'pull'")

    def _receive_push(self, msg: Message) -> dict[str, Any]:
        h = msg.header
        cluster, rnd, layer = h.get("cluster"), h.get("round"), h.get("layer")
        if not isinstance(cluster, str) or not isinstance(rnd, int):
            raise ValueError(f"push header fields cluster={cluster!r}, round={rnd!r} are invalid")
        if layer not in self.layers:
            raise ValueError(f"push field 'layer' = {layer!r} is not owned by follower {self.index}")
        expected = self.layers[layer]
        with self._lock:
            staged = self._staged.setdefault((rnd, cluster), _StagedPush())
            try:
                if sorted(msg.tensors) != sorted(expected):
                    raise ValueError(f"layer {layer!r}: tensors {sorted(msg.tensors)} != {expected}")
                for n in expected:
                    t = msg.tensors[n]
                    if tuple(t.shape) != tuple(self.params[n].shape):
                        raise ValueError(f"tensor {n!r}: shape {tuple(t.shape)}, expected "
                                         f"{tuple(self.params[n].shape)}")
                staged.layers[layer] = dict(msg.tensors)
            except ValueError as exc:
                staged.error = str(exc)
                raise
        return {"op": "ack", "layer": layer, "version": self.version}

    def _serve_pull(self, msg: Message) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
        want = msg.header.get("version")
        layers = msg.header.get("layers")
        if not isinstance(layers, list) or any(l not in self.layers for l in layers):
            raise ValueError(f"pull field 'layers' = {layers!r} not all owned by follower {self.index}")
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(msg.header.get("dtype", "bf16"))
        if dtype is None:
            raise ValueError(f"pull field 'dtype' = {msg.header.get('dtype')!r} not 'bf16' or 'fp32'")
        with self._lock:
            if want != self.version:
                raise ValueError(f"pull field 'version' = {want!r}, follower {self.index} "
                                 f"holds version {self.version}")
            out = [(n, self.params[n].to(dtype)) for l in layers for n in self.layers[l]]
            return {"op": "model", "version": self.version}, out

    # ----- control (called by the leader) ------------------------------------------------
    def score(self, rnd: int, clusters: list[str]) -> list[tuple[str, bool, float, str]]:
        """Per cluster: (id, valid, ‖Δ‖² on this shard, error). Δ = θ_now − θ_cluster (§6)."""
        out = []
        with self._lock:
            deltas = self._deltas.setdefault(rnd, {})
            for c in clusters:
                staged = self._staged.get((rnd, c))
                if staged is None or staged.error or set(staged.layers) != set(self.layers):
                    missing = sorted(set(self.layers) - set(staged.layers)) if staged else "all"
                    err = staged.error if staged and staged.error else f"layers missing: {missing}"
                    out.append((c, False, 0.0, err))
                    continue
                d = [pseudo_gradient(self.params[n], staged.layers[l][n])
                     for l, names in self.layers.items() for n in names]
                deltas[c] = d
                out.append((c, True, squared_norm(d), ""))
        return out

    def aggregate(self, rnd: int, clusters: list[str], weights: list[float]) -> float:
        """Form δ = Σ w_j Δ_j over ``clusters`` (already scored); return ‖δ‖² on this shard."""
        if len(clusters) != len(weights) or not clusters:
            raise ValueError(f"aggregate: {len(clusters)} clusters but {len(weights)} weights")
        with self._lock:
            deltas = self._deltas.get(rnd, {})
            missing = [c for c in clusters if c not in deltas]
            if missing:
                raise ValueError(f"aggregate round {rnd}: clusters {missing} were not scored here")
            mean = weighted_mean([deltas[c] for c in clusters], list(weights))
            self._mean[rnd] = (list(clusters), list(weights), mean)
            return squared_norm(mean)

    def apply(self, rnd: int, clip: float, new_version: int, accepted: list[str],
              weights: list[float]) -> tuple[int, str]:
        """Apply the outer step of ``rnd``: θ ← Nesterov(θ, clip·δ); version ← new_version.

        Idempotent: repeating the call for an already applied round returns the same result
        without applying twice. Raises ValueError if the version does not follow, or if the
        accepted set/weights differ from those aggregated.
        """
        with self._lock:
            if rnd in self._applied_rounds:
                return self._applied_rounds[rnd]
            if new_version != self.version + 1:
                raise ValueError(f"apply field 'new_version' = {new_version}, shard is at "
                                 f"version {self.version}")
            if rnd not in self._mean:
                raise ValueError(f"apply round {rnd}: nothing aggregated")
            clusters, w, mean = self._mean[rnd]
            if clusters != list(accepted) or [round(x, 12) for x in w] != [round(x, 12) for x in weights]:
                raise ValueError(f"apply round {rnd}: accepted {accepted} differs from "
                                 f"aggregated {clusters}")
            if not (0.0 < clip <= 1.0):
                raise ValueError(f"apply field 'clip_factor' = {clip} not in (0, 1]")
            nesterov_step([self.params[n] for n in self.names], [self.momenta[n] for n in self.names],
                          mean, self.outer_lr, self.outer_momentum, scale=clip)
            self.version = new_version
            checksum = shard_checksum(self.params)
            self._applied_rounds[rnd] = (self.version, checksum)
            self._drop(rnd)
            if self._log:
                with open(self._log, "a") as f:
                    f.write(json.dumps({"version": self.version, "round": rnd,
                                        "accepted": list(accepted), "weights": list(weights),
                                        "clip_factor": clip, "checksum": checksum,
                                        "time": time.time()}) + "\n")
            return self.version, checksum

    def discard(self, rnd: int) -> None:
        """Drop everything staged for rounds <= ``rnd`` (a round with nothing accepted)."""
        with self._lock:
            self._drop(rnd)

    def _drop(self, rnd: int) -> None:
        for key in [k for k in self._staged if k[0] <= rnd]:
            del self._staged[key]
        for d in (self._deltas, self._mean):
            for r in [r for r in d if r <= rnd]:
                del d[r]

    def state(self) -> tuple[int, int, str]:
        """(index, version, checksum of the shard)."""
        with self._lock:
            return self.index, self.version, shard_checksum(self.params)
