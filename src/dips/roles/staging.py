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

A sink writes into buffers it holds through a :class:`Lease`, which the follower revokes when
the push's record is dropped (its round closed): a stream still open then (a member that
sent BEGIN and nothing more) neither keeps its buffers nor writes into them once they are
back in the pool (issue 13).
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any, Callable, Sequence

import torch

from dips.algo import pseudo_gradient, squared_norm
from dips.algo.refusal import Refusal, Refused
from dips.algo.aggregate import NORM_CHUNK  # block size of squared_norm: equal sums bit for bit
from dips.wire.frames import DTYPES
from dips.wire.pool import VersionedSnapshots
from dips.wire.stream import TensorSpec


def check_specs(layer: str, specs: Sequence[TensorSpec], expected: dict[str, tuple[int, ...]],
                dtype: str | None = None) -> None:
    """Refuse a pushed layer whose tensors are not exactly ``expected`` (name -> shape) in
    the wire dtype ``dtype`` ("bf16" | "fp32"; None: either). Both push paths call it before
    anything is allocated for the layer.

    Raises ValueError naming the layer and the offending tensor, shape or dtype.
    """
    names = [s.name for s in specs]
    if len(names) != len(expected) or sorted(names) != sorted(expected):
        raise ValueError(f"layer {layer!r}: tensors {sorted(names)[:20]} != {sorted(expected)}")
    for s in specs:
        if tuple(s.shape) != tuple(expected[s.name]):
            raise ValueError(f"tensor {s.name!r}: shape {tuple(s.shape)}, expected "
                             f"{tuple(expected[s.name])}")
        if dtype is not None and s.dtype != dtype:
            raise ValueError(f"tensor {s.name!r}: dtype {s.dtype!r}, the run's wire dtype is "
                             f"{dtype!r}")


def block_sq(name: str, block: torch.Tensor) -> float:
    """‖block‖² of one block of Δ (at most ``NORM_CHUNK`` elements, :func:`dips.algo.squared_norm`).

    The one value check of a pushed Δ, on both push paths: the result must be finite, which
    refuses NaN and Inf and every value so large that its square overflows FP32 in the
    norm's row sums (|Δ| above about 1.8e19, less for a row of several such values) — a
    push that would otherwise make its score, and the round's decision, infinite (issue 13).
    Raises ValueError naming the tensor.
    """
    part = squared_norm([block])
    if not math.isfinite(part):
        raise ValueError(f"tensor {name!r} contains NaN or Inf, or values too large to score "
                         f"(‖Δ‖² of a block = {part})")
    return part


def delta_sq(name: str, delta: torch.Tensor) -> float:
    """‖Δ‖² of a whole tensor, block by block through :func:`block_sq` (the same blocks and
    order as :class:`DeltaSink`: equal bit for bit to ``squared_norm([delta])``). Raises
    ValueError as :func:`block_sq`."""
    flat = delta.reshape(-1)
    total = 0.0
    for start in range(0, flat.numel(), NORM_CHUNK):
        total += block_sq(name, flat[start:start + NORM_CHUNK])
    return total


class Lease:
    """The buffers ``tensors`` (name -> tensor) that the sinks of one push write into, until
    :meth:`revoke` (the push's record was dropped).

    A sink holds :attr:`lock` while it writes, and :meth:`revoke` takes it: a write in
    progress finishes first, later ones are refused (:meth:`check`), and only then do the
    buffers go to ``release`` (e.g. the pool's), once. Never hold :attr:`lock` while waiting
    for the follower's lock (the follower revokes while it holds its own).
    """

    def __init__(self, tensors: dict[str, torch.Tensor],
                 release: Callable[[dict[str, torch.Tensor]], None] | None = None) -> None:
        self.tensors: dict[str, torch.Tensor] | None = tensors
        self._release = release
        self.lock = threading.Lock()

    @property
    def revoked(self) -> bool:
        return self.tensors is None

    def check(self) -> dict[str, torch.Tensor]:
        """The buffers (hold :attr:`lock`). Raises Refused(STALE_GRANT) once revoked."""
        if self.tensors is None:
            raise Refused(Refusal.STALE_GRANT, "the push's round closed while this layer was "
                                               "being received")
        return self.tensors

    def revoke(self) -> None:
        """No sink writes into the buffers from now on; they go back to ``release``."""
        with self.lock:
            tensors, self.tensors = self.tensors, None
        if tensors is not None and self._release is not None:
            self._release(tensors)


class DeltaSink:
    """Receives one pushed layer and forms Δ = θ − θ_local into the buffers of ``lease``
    (FP32, in place; a write after the lease was revoked is refused STALE_GRANT).

    Args:
        specs: the announced tensors (BF16 or FP32), in stream order.
        theta: the shard's current θ for each spec (FP32, same shape); read only.
        lease: holds the FP32 destination of each spec by name (same shape), fully
            overwritten.
        on_commit: called with ``{name: ‖Δ‖²}`` once every tensor is complete and finite
            (it raises to refuse, e.g. STALE_GRANT once the round closed).
        on_abort: called with the reason when the stream is refused.
        reply: the header returned by :meth:`commit`.
    """

    def __init__(self, specs: Sequence[TensorSpec], theta: Sequence[torch.Tensor],
                 lease: Lease, on_commit: Callable[[dict[str, float]], None],
                 on_abort: Callable[[str], None], reply: dict[str, Any]) -> None:
        self.specs = list(specs)
        self._theta = [t.reshape(-1) for t in theta]
        self._lease = lease
        self._numel = [math.prod(s.shape) for s in self.specs]
        self._size = [DTYPES[s.dtype].itemsize for s in self.specs]
        self._normed = [0] * len(self.specs)  # elements of each tensor already in _sq
        self._sq = [0.0] * len(self.specs)
        self._on_commit, self._on_abort, self._reply = on_commit, on_abort, reply

    @property
    def revoked(self) -> bool:
        """Whether the push's record was dropped (the server then drops this stream)."""
        return self._lease.revoked

    def write(self, index: int, offset: int, data: memoryview) -> None:
        """Form Δ for the elements of tensor ``index`` at byte ``offset`` from ``data``."""
        size = self._size[index]
        if offset % size or len(data) % size:
            raise ValueError(f"chunk of tensor {self.specs[index].name!r} at byte {offset} "
                             f"({len(data)} bytes) splits an element")
        start, count = offset // size, len(data) // size
        local = torch.frombuffer(data, dtype=DTYPES[self.specs[index].dtype], count=count)
        with self._lease.lock:
            delta = self._lease.check()[self.specs[index].name].view(-1)
            out = delta[start:start + count]
            # Widen BF16 -> FP32 into Δ, then Δ = θ − Δ in place: 2 passes at ~3 GB/s here,
            # against ~0.7 GB/s for a mixed-dtype subtraction.
            out.copy_(local)
            pseudo_gradient(self._theta[index][start:start + count], out, out=out)
            self._norm(index, delta, start + count)

    def _norm(self, index: int, d: torch.Tensor, end: int) -> None:
        # ‖Δ‖² of every block completed by this chunk, while it is still in cache. Blocks of
        # NORM_CHUNK elements, summed in order from 0.0, repeat squared_norm([Δ]) exactly.
        done, n = self._normed[index], self._numel[index]
        while done + NORM_CHUNK <= end or (end == n and done < n):
            stop = min(done + NORM_CHUNK, n)
            self._sq[index] += block_sq(self.specs[index].name, d[done:stop])
            done = stop
        self._normed[index] = done

    def commit(self) -> dict[str, Any]:
        """Report ‖Δ‖² per tensor (all chunks were written and found finite)."""
        self._lease.check()  # the round closed: refused as such, whatever arrived
        for s, done, n in zip(self.specs, self._normed, self._numel):
            if done != n:
                raise ValueError(f"tensor {s.name!r}: {done} of {n} elements received")
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
        """Raise ValueError if the version sent is gone (see the class docstring). The stream
        still reads its snapshot until :meth:`close`: the data plane hands libzmq views of
        it, and closes the source once they are written."""
        with self._lock:
            self._valid()

    def close(self) -> None:
        """Stop reading the snapshot (the stream's messages were written, or it was dropped
        or failed before its end)."""
        if self._release is not None:
            self._release()  # runs once: here, or when the stream is dropped
        self._snap = None


def _release(lock: Any, snap: Any) -> None:
    with lock:
        snap.readers -= 1


class RawSink:
    """Receives one layer of a push sent ahead of its round (§6, issue 10): the cluster's
    tensors are kept as they arrive (BF16), and Δ is formed only when the round that takes
    the push scores it, against θ as it is then — θ may change while a slow push travels.

    Args:
        specs: the announced tensors, in stream order.
        lease: holds a destination tensor per spec by name (its dtype and shape), fully
            overwritten (a write after the lease was revoked is refused STALE_GRANT).
        on_commit: called with the tensors once every byte arrived and every value is
            finite (it raises to refuse, e.g. STALE_GRANT once the push was dropped).
        on_abort: called with the reason when the stream is refused.
        reply: the header returned by :meth:`commit`.
    """

    def __init__(self, specs: Sequence[TensorSpec], lease: Lease,
                 on_commit: Callable[[dict[str, torch.Tensor]], None],
                 on_abort: Callable[[str], None], reply: dict[str, Any]) -> None:
        self.specs = list(specs)
        self._lease = lease
        self._nbytes = [math.prod(s.shape) * DTYPES[s.dtype].itemsize for s in self.specs]
        self._got = [0] * len(self.specs)
        self._on_commit, self._on_abort, self._reply = on_commit, on_abort, reply

    @property
    def revoked(self) -> bool:
        """Whether the push's record was dropped (the server then drops this stream)."""
        return self._lease.revoked

    def write(self, index: int, offset: int, data: memoryview) -> None:
        """Copy the bytes of tensor ``index`` at byte ``offset``."""
        size = self._nbytes[index]
        if offset + len(data) > size:
            raise ValueError(f"chunk of tensor {self.specs[index].name!r} at byte {offset} "
                             f"({len(data)} bytes) runs past its {size} bytes")
        with self._lease.lock:
            dst = self._lease.check()[self.specs[index].name].view(-1).view(torch.uint8)
            dst[offset:offset + len(data)].copy_(torch.frombuffer(data, dtype=torch.uint8))
        self._got[index] += len(data)

    def commit(self) -> dict[str, Any]:
        """Check every byte arrived and every value is finite; then keep the layer."""
        with self._lease.lock:
            tensors = self._lease.check()
            for s, got, size in zip(self.specs, self._got, self._nbytes):
                if got != size:
                    raise ValueError(f"tensor {s.name!r}: {got} of {size} bytes received")
                if not bool(torch.isfinite(tensors[s.name]).all()):
                    raise ValueError(f"tensor {s.name!r} contains NaN or Inf")
        self._on_commit(tensors)
        return dict(self._reply)

    def abort(self, reason: str) -> None:
        self._on_abort(reason)
