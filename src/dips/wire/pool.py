"""Preallocated, reused buffers for the data plane (§10 of the seed: "memory pool").

Fresh memory costs about 1 GB/s to touch for the first time on the project machine, against
≈ 11 GB/s for a copy into memory already touched; a 400 MB push into fresh buffers would
spend more time in page faults than on the wire. Every large buffer of the data plane
therefore comes from one of these pools and goes back to it:

* :class:`TensorPool`: sets of tensors with one layout (e.g. a follower's FP32 Δ for one
  cluster's push), handed out and returned whole.
* :class:`VersionedSnapshots`: BF16 images of a shard by version, built once per version
  and served to every puller; the buffers of the oldest kept version are recycled.

Received chunks need no pool of their own: the data server forms Δ straight from the frame
libzmq received each chunk into (:mod:`dips.wire.dataplane`), a buffer of one chunk that the
allocator hands back for the next one, and a pull lands in the stage worker's reused BF16
buffers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


class TensorPool:
    """Reusable sets of tensors of one layout ``{name: (shape, dtype)}``.

    :meth:`acquire` returns a set whose contents are undefined (the caller overwrites every
    element); :meth:`release` gives it back. At most ``keep`` idle sets are retained.

    Attributes:
        allocated: sets created so far (each touched for the first time once).
        reused: acquisitions served from an idle set.
        live: sets handed out and not given back (what the data plane holds right now).
    """

    def __init__(self, layout: Layout, keep: int = 4) -> None:
        self.layout = dict(layout)
        self.keep = keep
        self._idle: list[dict[str, torch.Tensor]] = []
        self._lock = threading.Lock()
        self.allocated = 0
        self.reused = 0
        self.live = 0

    def acquire(self) -> dict[str, torch.Tensor]:
        with self._lock:
            self.live += 1
            if self._idle:
                self.reused += 1
                return self._idle.pop()
            self.allocated += 1
        return {n: torch.empty(shape, dtype=dtype) for n, (shape, dtype) in self.layout.items()}

    def release(self, tensors: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self.live -= 1
            if len(self._idle) < self.keep:
                self._idle.append(tensors)


@dataclass
class Snapshot:
    """A BF16 image of some tensors at one version; ``ready`` names those already filled;
    ``readers`` counts the pull streams still sending from it (it is never recycled then)."""

    version: int
    tensors: dict[str, torch.Tensor]
    ready: set[str] = field(default_factory=set)
    readers: int = 0

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.tensors)

    def fill(self, name: str, source: torch.Tensor) -> torch.Tensor:
        """The BF16 image of ``name``, converted from ``source`` the first time it is asked for."""
        if name not in self.ready:
            self.tensors[name].copy_(source)
            self.ready.add(name)
        return self.tensors[name]


class VersionedSnapshots:
    """Snapshots (by version) of tensors with one layout; ``keep`` of them are retained.

    When a new version's snapshot is needed and ``keep`` exist, the buffers of the oldest one
    that no pull stream is reading (``readers == 0``) are recycled; if every one is being read
    (slow pullers of older versions), a new set is allocated instead, so a puller never sends
    from buffers that change under it. Not thread-safe: callers hold their own lock.
    """

    def __init__(self, layout: Layout, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep = {keep} must be >= 1")
        self.layout = dict(layout)
        self.keep = keep
        self._snaps: dict[int, Snapshot] = {}
        self.allocated = 0

    def complete(self, version: int, source: Callable[[str], torch.Tensor]) -> None:
        """Fill the not yet converted tensors of ``version``'s snapshot (if one is held) from
        ``source(name)``, so it can keep serving after the source changes."""
        snap = self._snaps.get(version)
        if snap is not None:
            for name in snap.tensors:
                snap.fill(name, source(name))

    def forget_after(self, version: int) -> None:
        """Drop the snapshots of versions newer than ``version`` (after a rollback their
        numbers will be reused for other contents); streams still reading one keep it."""
        for v in [v for v in self._snaps if v > version]:
            del self._snaps[v]

    def peek(self, version: int) -> Snapshot | None:
        """The snapshot of ``version`` if one is held, else None (nothing is created)."""
        return self._snaps.get(version)

    def get(self, version: int) -> Snapshot:
        """The snapshot of ``version`` (created empty, recycling an unread old one, if absent)."""
        snap = self._snaps.get(version)
        if snap is not None:
            return snap
        idle = sorted(v for v, sn in self._snaps.items() if sn.readers == 0)
        if len(self._snaps) >= self.keep and idle:
            tensors = self._snaps.pop(idle.pop(0)).tensors
        else:
            self.allocated += 1
            tensors = {n: torch.empty(s, dtype=d) for n, (s, d) in self.layout.items()}
        snap = Snapshot(version, tensors)
        self._snaps[version] = snap
        while len(self._snaps) > self.keep and idle:  # sets added while all were being read
            del self._snaps[idle.pop(0)]
        return snap
