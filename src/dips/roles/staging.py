"""Consumers and producers of tensor streams for a follower's shard (§6, §10 of the seed).

:class:`DeltaSink` turns the chunks of one pushed layer into the pseudo-gradient as they
arrive: each BF16 chunk is widened into the FP32 Δ buffer (a pooled buffer, see
:mod:`dips.wire.pool`) and subtracted from the shard's current θ in place, Δ = θ − θ_local
(:func:`dips.algo.pseudo_gradient`, §6); ‖Δ‖² is accumulated with
:func:`dips.algo.squared_norm` block by block as the chunks complete them (refusing NaN/Inf
at once), so the scoring of §8 finds it ready. The follower forms Δ
at receipt rather than at scoring: the leader never applies an outer step while a round's
pushes are being received, so θ is the same at both times and the result is bit-identical.

:class:`SnapshotSource` is what a pull stream sends: tensors produced one at a time, so
converting the next layer overlaps sending the current one.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Sequence

import torch

from dips.algo import pseudo_gradient, squared_norm
from dips.algo.aggregate import NORM_CHUNK  # block size of squared_norm: equal sums bit for bit
from dips.wire.frames import DTYPES
from dips.wire.pool import VersionedSnapshots
from dips.wire.stream import TensorSpec


def check_specs(layer: str, specs: Sequence[TensorSpec], expected: dict[str, tuple[int, ...]]) -> None:
    """Refuse a pushed layer whose tensors are not exactly ``expected`` (name -> shape).

    Raises ValueError naming the layer and the offending tensor, shape or dtype.
    """
    names = [s.name for s in specs]
    if sorted(names) != sorted(expected):
        raise ValueError(f"layer {layer!r}: tensors {sorted(names)} != {sorted(expected)}")
    for s in specs:
        if tuple(s.shape) != tuple(expected[s.name]):
            raise ValueError(f"tensor {s.name!r}: shape {tuple(s.shape)}, expected "
                             f"{tuple(expected[s.name])}")


class DeltaSink:
    """Receives one pushed layer and forms Δ = θ − θ_local into ``delta`` (FP32, in place).

    Args:
        specs: the announced tensors (BF16 or FP32), in stream order.
        theta: the shard's current θ for each spec (FP32, same shape); read only.
        delta: FP32 destination for each spec (same shape); fully overwritten.
        on_commit: called with ``{name: ‖Δ‖²}`` once every tensor is complete and finite.
        on_abort: called with the reason when the stream is refused.
        reply: the header returned by :meth:`commit`.
    """

    def __init__(self, specs: Sequence[TensorSpec], theta: Sequence[torch.Tensor],
                 delta: Sequence[torch.Tensor], on_commit: Callable[[dict[str, float]], None],
                 on_abort: Callable[[str], None], reply: dict[str, Any]) -> None:
        self.specs = list(specs)
        self._theta = [t.reshape(-1) for t in theta]
        self._delta = [d.reshape(-1) for d in delta]
        self._size = [DTYPES[s.dtype].itemsize for s in self.specs]
        self._normed = [0] * len(self.specs)  # elements of each tensor already in _sq
        self._sq = [0.0] * len(self.specs)
        self._on_commit, self._on_abort, self._reply = on_commit, on_abort, reply

    def write(self, index: int, offset: int, data: memoryview) -> None:
        """Form Δ for the elements of tensor ``index`` at byte ``offset`` from ``data``."""
        size = self._size[index]
        if offset % size or len(data) % size:
            raise ValueError(f"chunk of tensor {self.specs[index].name!r} at byte {offset} "
                             f"({len(data)} bytes) splits an element")
        start, count = offset // size, len(data) // size
        local = torch.frombuffer(data, dtype=DTYPES[self.specs[index].dtype], count=count)
        out = self._delta[index][start:start + count]
        # Widen BF16 -> FP32 into Δ, then Δ = θ − Δ in place: 2 passes at ~3 GB/s here,
        # against ~0.7 GB/s for a mixed-dtype subtraction.
        out.copy_(local)
        pseudo_gradient(self._theta[index][start:start + count], out, out=out)
        self._norm(index, start + count)

    def _norm(self, index: int, end: int) -> None:
        # ‖Δ‖² of every block completed by this chunk, while it is still in cache. Blocks of
        # NORM_CHUNK elements, summed in order from 0.0, repeat squared_norm([Δ]) exactly.
        d, done, n = self._delta[index], self._normed[index], self._delta[index].numel()
        while done + NORM_CHUNK <= end or (end == n and done < n):
            stop = min(done + NORM_CHUNK, n)
            part = squared_norm([d[done:stop]])
            if not math.isfinite(part):
                raise ValueError(f"tensor {self.specs[index].name!r} contains NaN or Inf")
            self._sq[index] += part
            done = stop
        self._normed[index] = done

    def commit(self) -> dict[str, Any]:
        """Report ‖Δ‖² per tensor (all chunks were written and found finite)."""
        for s, done, d in zip(self.specs, self._normed, self._delta):
            if done != d.numel():
                raise ValueError(f"tensor {s.name!r}: {done} of {d.numel()} elements received")
        self._on_commit({s.name: sq for s, sq in zip(self.specs, self._sq)})
        return dict(self._reply)

    def abort(self, reason: str) -> None:
        self._on_abort(reason)


class SnapshotSource:
    """A pull stream of ``names`` at ``version`` from a shard (``header``, ``specs``,
    ``tensor(i)`` on demand, ``finish()``), see ``FollowerShard.open_pull``.

    BF16 tensors come from the version's snapshot in ``snaps``: while ``version`` is current
    (``current()`` passes) each is converted from θ the first time any puller asks for it,
    under ``lock``; later pullers get the same buffer without converting. Once the shard
    moved on, a snapshot of ``version`` that was completed before θ changed (the follower's
    commit completes it) keeps serving: a slow puller gets its whole version while newer ones
    are committed. The stream counts as a reader of its snapshot until :meth:`finish` or until
    it is dropped, so the snapshot is never recycled under it. FP32 tensors (export) are
    copies of the current θ. ``current()`` raises ValueError when the version is neither
    current nor completely snapshotted, which fails the stream instead of ending it, so a
    puller never mixes versions.
    """

    def __init__(self, version: int, names: list[str], dtype: str, lock: Any,
                 theta: Callable[[str], torch.Tensor], current: Callable[[], None],
                 snaps: VersionedSnapshots) -> None:
        self.header = {"op": "model", "version": version}
        self._names, self._dtype, self._lock = names, dtype, lock
        self._theta, self._current, self._snaps = theta, current, snaps
        self._snap, self._release = None, None
        with lock:
            old = snaps.peek(version) if dtype == "bf16" else None
            if old is None or not old.complete:
                current()
            self.specs = [TensorSpec(n, dtype, tuple(theta(n).shape)) for n in names]
            if dtype == "bf16":
                self._snap = snaps.get(version)
                self._snap.readers += 1
                self._release = weakref.finalize(self, _release, lock, self._snap)

    def _valid(self) -> None:
        if self._snap is None or not self._snap.complete:
            self._current()

    def tensor(self, index: int) -> torch.Tensor:
        name = self._names[index]
        with self._lock:
            self._valid()
            if self._snap is None:
                return self._theta(name).clone()
            return self._snap.fill(name, self._theta(name))

    def finish(self) -> None:
        try:
            with self._lock:
                self._valid()
        finally:
            if self._release is not None:
                self._release()  # runs once, here or when the stream is dropped


def _release(lock: Any, snap: Any) -> None:
    with lock:
        snap.readers -= 1


class RawSink:
    """Receives one layer of a push sent ahead of its round (§6, issue 10): the cluster's
    tensors are kept as they arrive (BF16), and Δ is formed only when the round that takes
    the push scores it, against θ as it is then — θ may change while a slow push travels.

    Args:
        specs: the announced tensors, in stream order.
        out: a destination tensor per spec (its dtype and shape), fully overwritten.
        on_commit: called once every byte arrived and every value is finite.
        on_abort: called with the reason when the stream is refused.
        reply: the header returned by :meth:`commit`.
    """

    def __init__(self, specs: Sequence[TensorSpec], out: Sequence[torch.Tensor],
                 on_commit: Callable[[], None], on_abort: Callable[[str], None],
                 reply: dict[str, Any]) -> None:
        self.specs = list(specs)
        self._out = [t.reshape(-1).view(torch.uint8) for t in out]
        self._tensors = list(out)
        self._got = [0] * len(self.specs)
        self._on_commit, self._on_abort, self._reply = on_commit, on_abort, reply

    def write(self, index: int, offset: int, data: memoryview) -> None:
        """Copy the bytes of tensor ``index`` at byte ``offset``."""
        dst = self._out[index]
        if offset + len(data) > dst.numel():
            raise ValueError(f"chunk of tensor {self.specs[index].name!r} at byte {offset} "
                             f"({len(data)} bytes) runs past its {dst.numel()} bytes")
        dst[offset:offset + len(data)].copy_(torch.frombuffer(data, dtype=torch.uint8))
        self._got[index] += len(data)

    def commit(self) -> dict[str, Any]:
        """Check every byte arrived and every value is finite; then keep the layer."""
        for s, got, dst, t in zip(self.specs, self._got, self._out, self._tensors):
            if got != dst.numel():
                raise ValueError(f"tensor {s.name!r}: {got} of {dst.numel()} bytes received")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"tensor {s.name!r} contains NaN or Inf")
        self._on_commit()
        return dict(self._reply)

    def abort(self, reason: str) -> None:
        self._on_abort(reason)
