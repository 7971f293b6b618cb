"""The data-plane side of a follower (§5, §10): pushes staged per (round, cluster) or, sent
ahead of their round, per push id; pulls served from the current version's snapshot.

A mixin of :class:`dips.roles.follower.FollowerShard`, which owns the shard's state (its
lock, θ, version, staged pushes) and the control side; split out to keep each module small.
See :mod:`dips.roles.follower` for the protocol.
"""


from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from dips.algo.refusal import Refusal, Refused
from dips.roles import failpoints
from dips.roles.round_sum import RoundSum
from dips.roles.staging import DeltaSink, RawSink, SnapshotSource, check_specs
from dips.wire.frames import DTYPES, Message
from dips.wire.pki import Identity
from dips.wire.pool import TensorPool, VersionedSnapshots
from dips.wire.stream import TensorSpec


@dataclass
class StagedPush:
    """What one cluster sent for one round; ``error`` set if any layer was refused.

    ``layers``: single-message pushes (BF16 tensors, Δ formed when scored). ``delta``: a
    pooled FP32 Δ for the whole shard, filled by streamed pushes as they arrive (§10);
    ``done`` names its complete layers and ``sq`` holds ‖Δ‖² per tensor. The pool gets
    ``delta`` back when this record is dropped (see ``FollowerShard.open_push``).
    """

    layers: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    error: str | None = None
    delta: dict[str, torch.Tensor] | None = None
    done: set[str] = field(default_factory=set)
    sq: dict[str, float] = field(default_factory=dict)
    formed: dict[str, torch.Tensor] = field(default_factory=dict)  # Δ of single-message layers


class DataPlaneSide:
    """Push and pull handlers of :class:`dips.roles.follower.FollowerShard`."""

    @staticmethod
    def authorize(sender: Identity, header: dict[str, Any]) -> None:
        """Who may send what (the sender is the identity its data-plane key was issued to):
        a push only by the cluster it names, a pull by a cluster or an observer (the
        operator). Raises Refused(FORBIDDEN) naming both."""
        op = header.get("op")
        if op == "push" and (sender.role != "cluster" or header.get("cluster") != sender.id):
            raise Refused(Refusal.FORBIDDEN, f"a push naming cluster {header.get('cluster')!r} "
                                             f"under the key of {sender.name!r}")
        if op == "pull" and sender.role not in ("cluster", "admin"):
            raise Refused(Refusal.FORBIDDEN, f"{sender.name!r} may not pull")

    def handle(self, msg: Message) -> tuple[dict[str, Any], Sequence[tuple[str, torch.Tensor]]]:
        """Serve one data-plane message (see module docstring). Raises ValueError if malformed."""
        op = msg.header.get("op")
        if op == "push":
            return self._receive_push(msg), ()
        if op == "pull":
            return self._serve_pull(msg)
        raise ValueError(f"header field 'op' = {op!r} is not 'push' or 'pull'")

    def _push_fields(self, h: dict[str, Any]) -> tuple[str, int, str]:
        cluster, rnd, layer = h.get("cluster"), h.get("round"), h.get("layer")
        if not isinstance(cluster, str) or not isinstance(rnd, int):
            raise ValueError(f"push header fields cluster={cluster!r}, round={rnd!r} are invalid")
        if layer not in self.layers:
            raise ValueError(f"push field 'layer' = {layer!r} is not owned by follower {self.index}")
        return cluster, rnd, layer

    def _pull_fields(self, h: dict[str, Any]) -> tuple[Any, list[str], str]:
        want, layers, dname = h.get("version"), h.get("layers"), h.get("dtype", "bf16")
        if not isinstance(layers, list) or any(l not in self.layers for l in layers):
            raise ValueError(f"pull field 'layers' = {layers!r} not all owned by follower {self.index}")
        if dname not in ("bf16", "fp32"):
            raise ValueError(f"pull field 'dtype' = {dname!r} not 'bf16' or 'fp32'")
        return want, [n for l in layers for n in self.layers[l]], dname

    def _is_current(self, want: Any) -> None:
        if want != self.version:
            raise Refused(Refusal.VERSION_GONE, f"pull field 'version' = {want!r}, follower "
                                                f"{self.index} holds version {self.version}")

    def _early_push(self, header: dict[str, Any], cluster: str) -> StagedPush:
        """The record of a push sent ahead of its round (lock held); one per cluster."""
        pid = header.get("push_id")
        if not isinstance(pid, str) or not pid:
            raise ValueError(f"push field 'push_id' = {pid!r} is not a push id")
        entry = self._early.get(pid)
        if entry is None:
            for old in [p for p, e in self._early.items() if e[0] == cluster]:
                del self._early[old]  # a newer push of the cluster replaces it
            entry = self._early[pid] = (cluster, header.get("tokens"), StagedPush())
        if entry[0] != cluster:
            raise ValueError(f"push id {pid!r} belongs to cluster {entry[0]!r}, not {cluster!r}")
        return entry[2]

    def _phase_failpoint(self, rnd: int) -> None:
        """Fault injection: the first push message of a round arrives in its grace window
        (``window``), the later ones in its push phase (``push``)."""
        first = rnd not in self._rounds_seen
        self._rounds_seen = (self._rounds_seen | {rnd}) if len(self._rounds_seen) < 64 else {rnd}
        failpoints.hit("window" if first else "push")

    def _receive_push(self, msg: Message) -> dict[str, Any]:
        cluster, rnd, layer = self._push_fields(msg.header)
        self._phase_failpoint(rnd)
        with self._lock:
            if msg.header.get("stage") is True:
                staged = self._early_push(msg.header, cluster)
                check_specs(layer, [TensorSpec.of(n, t) for n, t in msg.tensors.items()],
                            {n: tuple(self.params[n].shape) for n in self.layers[layer]})
                staged.layers[layer] = dict(msg.tensors)
                return {"op": "ack", "layer": layer, "version": self.version}
            staged = self._staged.setdefault((rnd, cluster), StagedPush())
            try:
                self._round_sum(rnd).announce(cluster, msg.header.get("tokens"))
                check_specs(layer, [TensorSpec.of(n, t) for n, t in msg.tensors.items()],
                            {n: tuple(self.params[n].shape) for n in self.layers[layer]})
                staged.layers[layer] = dict(msg.tensors)
                staged.done.discard(layer)
            except ValueError as exc:
                staged.error = str(exc)
                raise
        return {"op": "ack", "layer": layer, "version": self.version}

    def _serve_pull(self, msg: Message) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
        failpoints.hit("pull")
        want, names, dname = self._pull_fields(msg.header)
        dtype = torch.float32 if dname == "fp32" else torch.bfloat16
        with self._lock:
            self._is_current(want)
            return {"op": "model", "version": self.version}, [(n, self.params[n].to(dtype))
                                                               for n in names]

    # ----- data plane: streams (§10; served by dips.wire.dataplane.DataServer) -----------
    def _stream_pools(self) -> tuple[TensorPool, VersionedSnapshots]:
        with self._lock:
            if getattr(self, "_pools", None) is None:
                shapes = {n: tuple(self.params[n].shape) for n in self.names}
                self._pools = (TensorPool({n: (s, torch.float32) for n, s in shapes.items()}),
                               VersionedSnapshots({n: (s, torch.bfloat16) for n, s in shapes.items()}))
            return self._pools

    def _round_sum(self, rnd: int) -> RoundSum:
        """The round's Σ T_j·Δ_j (:mod:`dips.roles.round_sum`), created on first use."""
        rs = self._sums.get(rnd)
        if rs is None:
            if getattr(self, "_sum_pool", None) is None:
                self._sum_pool = TensorPool({n: (tuple(self.params[n].shape), torch.float32)
                                             for n in self.names}, keep=2)
            rs = RoundSum({n: tuple(self.params[n].shape) for n in self.names},
                          self._sum_pool.acquire, self._sum_pool.release)
            self._sums[rnd] = rs
        return rs

    def _delta_of(self, rnd: int) -> Any:
        def delta(cluster: str, name: str) -> torch.Tensor:
            staged = self._staged[(rnd, cluster)]
            return staged.formed[name] if name in staged.formed else staged.delta[name]
        return delta

    def open_push(self, header: dict[str, Any], specs: list[TensorSpec]) -> DeltaSink:
        """Accept one streamed layer of a push: Δ is formed into a pooled FP32 buffer while its
        chunks arrive (:class:`dips.roles.staging.DeltaSink`). Raises ValueError naming the field;
        wrong tensors (or a later refused chunk, NaN, ...) also mark the cluster's push invalid
        on this shard, so the leader excludes it on every shard."""
        if header.get("op") != "push":
            raise ValueError(f"stream field 'op' = {header.get('op')!r} is not 'push'")
        cluster, rnd, layer = self._push_fields(header)
        self._phase_failpoint(rnd)
        if header.get("stage") is True:
            return self._open_early(header, cluster, layer, specs)
        pool, _ = self._stream_pools()
        with self._lock:
            staged = self._staged.setdefault((rnd, cluster), StagedPush())
            try:
                check_specs(layer, specs, {n: tuple(self.params[n].shape) for n in self.layers[layer]})
                self._round_sum(rnd).announce(cluster, header.get("tokens"))
            except ValueError as exc:
                staged.error = str(exc)
                raise
            if staged.delta is None:  # returned to the pool when the record is dropped
                staged.delta = pool.acquire()
                weakref.finalize(staged, pool.release, staged.delta)
            staged.done.discard(layer)
            theta = [self.params[s.name] for s in specs]
            reply = {"op": "ack", "layer": layer, "version": self.version}

        def commit(sq: dict[str, float]) -> None:
            with self._lock:
                staged.done.add(layer)
                staged.sq.update(sq)
                for n in self.layers[layer]:
                    staged.formed.pop(n, None)
                if self._staged.get((rnd, cluster)) is staged:  # not dropped meanwhile
                    self._round_sum(rnd).layer_done(cluster, self.layers[layer], self._delta_of(rnd))

        def abort(reason: str) -> None:
            with self._lock:
                staged.error = staged.error or reason

        return DeltaSink(specs, theta, [staged.delta[s.name] for s in specs], commit, abort, reply)

    def _open_early(self, header: dict[str, Any], cluster: str, layer: str,
                    specs: list[TensorSpec]) -> RawSink:
        """One streamed layer of a push sent ahead of its round: kept as sent, its Δ formed
        when the round that takes it is scored (θ may change meanwhile)."""
        with self._lock:
            staged = self._early_push(header, cluster)
            check_specs(layer, specs, {n: tuple(self.params[n].shape) for n in self.layers[layer]})
            out = {s.name: torch.empty(s.shape, dtype=DTYPES[s.dtype]) for s in specs}
            reply = {"op": "ack", "layer": layer, "version": self.version}

        def commit() -> None:
            with self._lock:
                staged.layers[layer] = out

        def abort(reason: str) -> None:
            with self._lock:
                staged.error = staged.error or reason

        return RawSink(specs, [out[s.name] for s in specs], commit, abort, reply)

    def open_pull(self, header: dict[str, Any]) -> SnapshotSource:
        """Serve a streamed pull of ``layers`` at ``version``. BF16 comes from a per-version
        snapshot: each tensor is converted once per version (under the lock, one at a time)
        and sent to every puller without it, so control calls and checkpoints never wait behind
        a transfer; FP32 (export) sends copies. Raises ValueError naming the field; a version
        change during the stream fails it instead of ending it (no puller mixes versions)."""
        failpoints.hit("pull")
        if header.get("op") != "pull":
            raise ValueError(f"stream field 'op' = {header.get('op')!r} is not 'pull'")
        want, names, dname = self._pull_fields(header)
        return SnapshotSource(want, names, dname, self._lock, lambda n: self.params[n],
                              lambda: self._is_current(want), self._stream_pools()[1])

    # ----- control (called by the leader) ------------------------------------------------
