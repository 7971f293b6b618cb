"""The data-plane side of a follower (§5, §10): pushes staged per (round, cluster) or, sent
ahead of their round, per push id; pulls served from the current version's snapshot.

A mixin of :class:`dips.roles.follower.FollowerShard`, which owns the shard's state (its
lock, θ, version, staged pushes) and the control side; split out to keep each module small.
See :mod:`dips.roles.follower` for the protocol.

Hostile input (issue 13): every header field is checked, and the push admitted (its ticket,
replay), before anything is allocated for it (:mod:`dips.roles.follower_admit`); the tensors
are checked against the shard (names, shapes, the run's wire dtype) before a buffer or a chunk
plan exists; both push paths refuse the same values (:func:`dips.roles.staging.block_sq`); a
layer of a push is received once (a second stream of it, open or done, is STALE_GRANT).

What a member can make the follower hold: a pushed stream writes into its push's buffers
through a :class:`~dips.roles.staging.Lease` that is revoked when the push's record is
dropped — its round closed (applied, discarded, aborted, restored over), or, sent ahead of
its round, replaced by the cluster's newer push — so a stream that sent BEGIN and then
nothing holds no buffer past its round (the data server answers it STALE_GRANT). Live FP32 Δ
buffers are therefore at most one per (round, cluster) admitted under the leader's ticket
in the rounds still open here (the leader grants one push per cluster at a time, so
clusters × open rounds), plus one round sum per open round with two or more pushes. A pull
of FP32 is the operator's (``admin``: export) unless the run's wire dtype is FP32; a
cluster pulls the run's wire dtype.
"""


from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from dips.algo import pseudo_gradient
from dips.algo.refusal import Refusal, Refused
from dips.roles import failpoints
from dips.roles.follower_admit import (
    MAX_EARLY_PUSHES,
    Admission,
    PushFields,
    bad,
    pull_fields,
    push_fields,
)
from dips.roles.round_sum import RoundSum
from dips.roles.staging import (
    DeltaSink,
    Lease,
    RawSink,
    SnapshotSource,
    check_specs,
    delta_sq,
)
from dips.wire.dataclient import STREAM_FRAME_BYTES
from dips.wire.frames import DTYPES, Message
from dips.wire.intake import MessageLimits, shard_limits
from dips.wire.pki import Identity
from dips.wire.pool import TensorPool, VersionedSnapshots
from dips.wire.seal import TAG_BYTES
from dips.wire.serving import SINGLE_REPLY_BYTES
from dips.wire.stream import TensorSpec


@dataclass
class StagedPush:
    """What one cluster sent for one round; ``error`` set if any layer was refused.

    ``layers``: single-message layers (BF16 tensors of a push sent ahead of its round, Δ
    formed when scored; an empty dict for a round's push, whose Δ is formed at receipt into
    ``formed``). ``delta``: a pooled FP32 Δ for the whole shard, filled by streamed pushes as
    they arrive (§10), through ``lease``; ``open`` names the layers being streamed, ``done``
    the complete ones, and ``sq`` holds ‖Δ‖² per tensor. When this record is dropped the
    lease is revoked: streams still open stop writing and the pool gets ``delta`` back (see
    ``FollowerShard.open_push``).
    """

    layers: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    error: str | None = None
    delta: dict[str, torch.Tensor] | None = None
    open: set[str] = field(default_factory=set)
    done: set[str] = field(default_factory=set)
    sq: dict[str, float] = field(default_factory=dict)
    formed: dict[str, torch.Tensor] = field(default_factory=dict)  # Δ of single-message layers
    lease: Lease | None = None


class DataPlaneSide:
    """Push and pull handlers of :class:`dips.roles.follower.FollowerShard`."""

    _admission: Admission
    wire_dtype: str | None

    def authorize(self, sender: Identity, header: dict[str, Any]) -> None:
        """Who may send what (the sender is the identity its data-plane key was issued to):
        a push only by the cluster it names; a pull by a cluster in the run's wire dtype
        (``outer.wire_dtype``; either without one: trusted in-process callers) or by an
        observer (the operator, ``admin``: FP32 for export). An FP32 pull copies θ per
        stream where BF16 is served from one shared snapshot. Raises Refused(FORBIDDEN)
        naming both."""
        op = header.get("op")
        if op == "push" and (sender.role != "cluster" or header.get("cluster") != sender.id):
            raise Refused(Refusal.FORBIDDEN, f"a push naming cluster "
                                             f"{str(header.get('cluster'))[:80]!r} under the key "
                                             f"of {sender.name!r}")
        if op == "pull":
            if sender.role not in ("cluster", "admin"):
                raise Refused(Refusal.FORBIDDEN, f"{sender.name!r} may not pull")
            dname = header.get("dtype", "bf16")
            if (sender.role == "cluster" and dname == "fp32"
                    and self.wire_dtype not in (None, "fp32")):
                raise Refused(Refusal.FORBIDDEN, f"{sender.name!r} may pull the run's wire dtype "
                                                 f"{self.wire_dtype!r}, not 'fp32' (the "
                                                 "operator's export pulls FP32)")

    def set_admission_key(self, key: bytes) -> None:
        """Check admission tickets under ``key`` (:func:`dips.wire.admission.admission_key` of
        the run's data secret) from now on."""
        with self._lock:
            self._admission.set_key(key)

    def max_message_bytes(self) -> int:
        """The largest frame a legitimate peer sends this follower (bytes; its data server's
        ``ZMQ_MAXMSGSIZE``): a chunk or a header, or the largest tensor of the shard in FP32
        (a single-message push) with its GCM tag."""
        largest = max((self.params[n].numel() * 4 for n in self.names), default=0)
        return max(largest + TAG_BYTES, STREAM_FRAME_BYTES)

    def message_limits(self) -> MessageLimits:
        """What one data-plane message of each kind may carry to this follower (its data
        server's :class:`~dips.wire.intake.MessageLimits`): frames of at most
        :meth:`max_message_bytes`, a single message of one layer in FP32 and a header, a
        header naming every tensor and layer of the shard."""
        shapes = {n: tuple(self.params[n].shape) for n in self.names}
        return shard_limits(shapes, self.layers, self.max_message_bytes())

    def handle(self, msg: Message) -> tuple[dict[str, Any], Sequence[tuple[str, torch.Tensor]]]:
        """Serve one data-plane message (see module docstring). Raises Refused or ValueError
        (a typed refusal for the reply) if it is malformed or not admitted."""
        op = msg.header.get("op")
        if op == "push":
            return self._receive_push(msg), ()
        if op == "pull":
            return self._serve_pull(msg)
        raise bad("op", op, "is not 'push' or 'pull'")

    def _expected(self, layer: str) -> dict[str, tuple[int, ...]]:
        return {n: tuple(self.params[n].shape) for n in self.layers[layer]}

    def _is_current(self, want: Any) -> None:
        if want != self.version:
            raise Refused(Refusal.VERSION_GONE, f"pull field 'version' = {want!r}, follower "
                                                f"{self.index} holds version {self.version}")

    def _fields(self, header: dict[str, Any]) -> PushFields:
        """The checked fields of a push header, and the fault-injection point of its phase."""
        if header.get("op") != "push":
            raise bad("op", header.get("op"), "is not 'push'")
        f = push_fields(header, self.layers, self.index)
        self._phase_failpoint(f.round)
        return f

    def _open(self, f: PushFields, header: dict[str, Any],
              specs: Sequence[TensorSpec]) -> tuple[PushFields, StagedPush]:
        """Admit one layer of a push (lock held): ``(fields with the ticket's T_j, the push's
        record)``. Nothing is allocated for a refused push but the record of an admitted one.

        Raises Refused (see :meth:`Admission.admit`; STALE_GRANT: the layer was sent already;
        BUSY: too many pushes sent ahead) or ValueError (tensors not the layer's: the push is
        then invalid on this shard, so the leader excludes it everywhere).
        """
        f = self._admission.admit(f, header, self.version)
        staged = self._early_push(f) if f.stage else self._staged.setdefault(
            (f.round, f.cluster), StagedPush())
        if f.layer in staged.layers or f.layer in staged.done or f.layer in staged.open:
            raise Refused(Refusal.STALE_GRANT, f"push {f.push_id} of {f.cluster!r} already sent "
                                               f"layer {f.layer!r} (a layer is received once)")
        try:
            check_specs(f.layer, specs, self._expected(f.layer), self.wire_dtype)
            if not f.stage:
                self._round_sum(f.round).announce(f.cluster, f.tokens)
        except ValueError as exc:
            staged.error = staged.error or str(exc)
            raise
        return f, staged

    def _early_push(self, f: PushFields) -> StagedPush:
        """The record of a push sent ahead of its round (lock held); one per cluster, at most
        :data:`MAX_EARLY_PUSHES` in all (BUSY beyond)."""
        entry = self._early.get(f.push_id)
        if entry is None:
            older = [p for p, e in self._early.items() if e[0] == f.cluster]
            if not older and len(self._early) >= MAX_EARLY_PUSHES:
                raise Refused(Refusal.BUSY, f"{len(self._early)} pushes sent ahead of their round "
                                            f"are held already")
            for old in older:  # a newer push of the cluster replaces it
                del self._early[old]
                self._admission.retire(old)
            entry = self._early[f.push_id] = (f.cluster, f.tokens, StagedPush())
        if entry[0] != f.cluster:
            raise Refused(Refusal.FORBIDDEN, f"push id {f.push_id!r} belongs to cluster "
                                             f"{entry[0]!r}, not {f.cluster!r}")
        return entry[2]

    def _phase_failpoint(self, rnd: int) -> None:
        """Fault injection: the first push message of a round arrives in its grace window
        (``window``), the later ones in its push phase (``push``)."""
        first = rnd not in self._rounds_seen
        self._rounds_seen = (self._rounds_seen | {rnd}) if len(self._rounds_seen) < 64 else {rnd}
        failpoints.hit("window" if first else "push")

    def _receive_push(self, msg: Message) -> dict[str, Any]:
        """A single-message push of one layer. A round's Δ is formed and checked at receipt,
        as a streamed push's is (:func:`~dips.roles.staging.delta_sq`); a push sent ahead of
        its round is kept as sent (finite values: the decoder checked) until scored."""
        f = self._fields(msg.header)
        specs = [TensorSpec.of(n, t) for n, t in msg.tensors.items()]
        with self._lock:
            f, staged = self._open(f, msg.header, specs)
            if f.stage:
                staged.layers[f.layer] = dict(msg.tensors)
                return {"op": "ack", "layer": f.layer, "version": self.version}
            try:
                formed = {n: pseudo_gradient(self.params[n], t) for n, t in msg.tensors.items()}
                sq = {n: delta_sq(n, d) for n, d in formed.items()}
            except ValueError as exc:
                staged.error = staged.error or str(exc)
                raise
            staged.formed.update(formed)
            staged.sq.update(sq)
            staged.layers[f.layer] = {}
            self._round_sum(f.round).layer_done(f.cluster, self.layers[f.layer],
                                                self._delta_of(f.round))
            return {"op": "ack", "layer": f.layer, "version": self.version}

    def _serve_pull(self, msg: Message) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
        failpoints.hit("pull")
        want, layers, dname = pull_fields(msg.header, self.layers, self.index)
        dtype = DTYPES[dname]
        size = sum(self.params[n].numel() * dtype.itemsize for l in layers for n in self.layers[l])
        if size > SINGLE_REPLY_BYTES:  # built whole on the consumer thread: a stream instead
            raise bad("layers", layers, f"asks for a single-message reply of {size} bytes, over "
                      f"the {SINGLE_REPLY_BYTES} one message carries: pull them as a stream")
        with self._lock:
            self._is_current(want)
            return {"op": "model", "version": self.version}, [
                (n, self.params[n].to(dtype)) for l in layers for n in self.layers[l]]

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

    def open_push(self, header: dict[str, Any], specs: list[TensorSpec]) -> DeltaSink | RawSink:
        """Accept one streamed layer of a push: Δ is formed into a pooled FP32 buffer while its
        chunks arrive (:class:`dips.roles.staging.DeltaSink`). Raises Refused or ValueError
        naming the field (see :meth:`_open`); nothing is allocated before the push is admitted
        and its tensors match the layer. A later refused chunk (NaN, a value too large, ...)
        marks the cluster's push invalid on this shard, so the leader excludes it everywhere."""
        f = self._fields(header)
        if f.stage:
            return self._open_early(f, header, specs)
        pool, _ = self._stream_pools()
        with self._lock:
            f, staged = self._open(f, header, specs)
            if staged.lease is None:  # revoked, and Δ back in the pool, when the record is dropped
                staged.delta = pool.acquire()
                staged.lease = Lease(staged.delta, pool.release)
                weakref.finalize(staged, staged.lease.revoke)
            staged.open.add(f.layer)
            theta = [self.params[s.name] for s in specs]
            reply = {"op": "ack", "layer": f.layer, "version": self.version}
            lease = staged.lease
        rnd, cluster, layer = f.round, f.cluster, f.layer
        record = weakref.ref(staged)  # the sink must not keep a dropped record (its Δ) alive
        del staged

        def commit(sq: dict[str, float]) -> None:
            with self._lock:
                staged = record()
                if staged is None or self._staged.get((rnd, cluster)) is not staged:
                    raise Refused(Refusal.STALE_GRANT, f"round {rnd} closed while layer "
                                                       f"{layer!r} of {cluster!r} was received")
                staged.open.discard(layer)
                staged.done.add(layer)
                staged.sq.update(sq)
                self._round_sum(rnd).layer_done(cluster, self.layers[layer], self._delta_of(rnd))

        def abort(reason: str) -> None:
            with self._lock:
                staged = record()
                if staged is not None:
                    staged.open.discard(layer)
                    staged.error = staged.error or reason

        return DeltaSink(specs, theta, lease, commit, abort, reply)

    def _open_early(self, f: PushFields, header: dict[str, Any],
                    specs: list[TensorSpec]) -> RawSink:
        """One streamed layer of a push sent ahead of its round: kept as sent, its Δ formed
        when the round that takes it is scored (θ may change meanwhile)."""
        with self._lock:
            f, staged = self._open(f, header, specs)
            lease = Lease({s.name: torch.empty(s.shape, dtype=DTYPES[s.dtype]) for s in specs})
            weakref.finalize(staged, lease.revoke)  # replaced or dropped: the stream stops
            staged.open.add(f.layer)
            reply = {"op": "ack", "layer": f.layer, "version": self.version}
        layer, push_id = f.layer, f.push_id
        record = weakref.ref(staged)
        del staged

        def commit(out: dict[str, torch.Tensor]) -> None:
            with self._lock:
                staged = record()
                if staged is None:
                    raise Refused(Refusal.STALE_GRANT, f"push {push_id} was replaced, or its "
                                                       f"round closed, while layer {layer!r} "
                                                       "was received")
                staged.open.discard(layer)
                staged.layers[layer] = out

        def abort(reason: str) -> None:
            with self._lock:
                staged = record()
                if staged is not None:
                    staged.open.discard(layer)
                    staged.error = staged.error or reason

        return RawSink(specs, lease, commit, abort, reply)

    def open_pull(self, header: dict[str, Any]) -> SnapshotSource:
        """Serve a streamed pull of ``layers`` at ``version``. BF16 comes from a per-version
        snapshot: each tensor is converted once per version (under the lock, one at a time)
        and sent to every puller without it, so control calls and checkpoints never wait behind
        a transfer; FP32 (export) sends copies. Raises Refused (INVALID_ARGUMENT naming the
        field, VERSION_GONE); a version change during the stream fails it instead of ending
        it (no puller mixes versions)."""
        failpoints.hit("pull")
        if header.get("op") != "pull":
            raise bad("op", header.get("op"), "is not 'pull'")
        want, layers, dname = pull_fields(header, self.layers, self.index)
        names = [n for l in layers for n in self.layers[l]]
        return SnapshotSource(want, names, dname, self._lock, lambda n: self.params[n],
                              lambda: self._is_current(want), self._stream_pools()[1])

    # ----- control (called by the leader) ------------------------------------------------
