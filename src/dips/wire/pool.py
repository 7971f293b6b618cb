"""Preallocated, reused buffers for the data plane (§10 of the seed: "memory pool").

Fresh memory costs about 1 GB/s to touch for the first time on the project machine, against
≈ 11 GB/s for a copy into memory already touched; a 400 MB push into fresh buffers would
spend more time in page faults than on the wire. Every large buffer of the data plane
therefore comes from one of these pools and goes back to it:

* :class:`ChunkRing`: a fixed number of receive buffers of the largest chunk size; the
  receiving thread blocks when all are in use (back-pressure instead of unbounded queues).
* :class:`TensorPool`: sets of tensors with one layout (e.g. a follower's FP32 Δ for one
  cluster's push), handed out and returned whole.
* :class:`VersionedSnapshots`: BF16 images of a shard by version, built once per version
  and served to every puller; the buffers of the oldest kept version are recycled.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import torch


class ChunkRing:
    """``count`` receive buffers of ``nbytes`` each, all touched once at creation.

    Raises ValueError if ``count`` < 1 or ``nbytes`` < 1.
    """

    def __init__(self, count: int = 8, nbytes: int = 4 << 20) -> None:
        if count < 1 or nbytes < 1:
            raise ValueError(f"ChunkRing(count={count}, nbytes={nbytes}): both must be >= 1")
        self.nbytes = nbytes
        self._free: queue.Queue[bytearray] = queue.Queue()
        for _ in range(count):
            self._free.put(bytearray(nbytes))  # bytearray() zero-fills: first touch now

    def get(self, timeout_s: float) -> bytearray | None:
        """A free buffer, or None if none came free within ``timeout_s`` seconds."""
        try:
            return self._free.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def put(self, buf: bytearray) -> None:
        self._free.put(buf)


Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


class TensorPool:
    """Reusable sets of tensors of one layout ``{name: (shape, dtype)}``.

    :meth:`acquire` returns a set whose contents are undefined (the caller overwrites every
    element); :meth:`release` gives it back. At most ``keep`` idle sets are retained.

    Attributes:
        allocated: sets created so far (each touched for the first time once).
        reused: acquisitions served from an idle set.
    """

    def __init__(self, layout: Layout, keep: int = 4) -> None:
        self.layout = dict(layout)
        self.keep = keep
        self._idle: list[dict[str, torch.Tensor]] = []
        self._lock = threading.Lock()
        self.allocated = 0
        self.reused = 0

    def acquire(self) -> dict[str, torch.Tensor]:
        with self._lock:
            if self._idle:
                self.reused += 1
                return self._idle.pop()
            self.allocated += 1
        return {n: torch.empty(shape, dtype=dtype) for n, (shape, dtype) in self.layout.items()}

    def release(self, tensors: dict[str, torch.Tensor]) -> None:
        with self._lock:
            if len(self._idle) < self.keep:
                self._idle.append(tensors)


@dataclass
class Snapshot:
    """A BF16 image of some tensors at one version; ``ready`` names those already filled."""

    version: int
    tensors: dict[str, torch.Tensor]
    ready: set[str] = field(default_factory=set)


class VersionedSnapshots:
    """At most ``keep`` snapshots (by version) of tensors with one layout.

    A snapshot's buffers are recycled only once ``keep`` newer versions exist, so a puller
    that is still sending an older version from the same buffers would need to lag ``keep``
    versions behind; even then its receiver refuses the chunks (their tags no longer match),
    it never accepts mixed data. Not thread-safe: callers hold their own lock.
    """

    def __init__(self, layout: Layout, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep = {keep} must be >= 1")
        self.layout = dict(layout)
        self.keep = keep
        self._snaps: dict[int, Snapshot] = {}
        self.allocated = 0

    def get(self, version: int) -> Snapshot:
        """The snapshot of ``version`` (created empty, recycling the oldest, if absent)."""
        snap = self._snaps.get(version)
        if snap is not None:
            return snap
        if len(self._snaps) >= self.keep:
            oldest = min(self._snaps)
            tensors = self._snaps.pop(oldest).tensors
        else:
            self.allocated += 1
            tensors = {n: torch.empty(s, dtype=d) for n, (s, d) in self.layout.items()}
        snap = Snapshot(version, tensors)
        self._snaps[version] = snap
        return snap
