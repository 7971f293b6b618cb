"""The simulator's event queue: :class:`dips.emu.vclock.EventQueue`'s order on plain tuples.

Events are ordered by (time s, priority, insertion order), exactly as
:class:`dips.emu.vclock.EventQueue` orders them, but held as tuples, which the heap compares in
C: a run of 1,024 clusters pushes tens of millions of events, and the dataclass comparisons of
the general queue cost more than the rest of the simulation together (profiled: 27% of the
time of a 64-cluster run).
"""

from __future__ import annotations

import heapq
import math
from typing import Any

__all__ = ["FastQueue"]


class FastQueue:
    """Min-heap of ``(time, priority, seq, kind, payload)``; same interface and order as
    :class:`dips.emu.vclock.EventQueue` (``push``, ``pop``, ``len``, ``now`` in seconds)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, str, Any]] = []
        self._seq = 0
        self.now = 0.0

    def push(self, time: float, kind: str, payload: Any = None, priority: int = 0) -> None:
        """Schedule ``kind`` at ``time`` seconds. Raises ValueError for a past or non-finite time."""
        if not time >= self.now or not math.isfinite(time):
            raise ValueError(f"event {kind!r}: time = {time} is before now = {self.now} or not finite")
        heapq.heappush(self._heap, (time, priority, self._seq, kind, payload))
        self._seq += 1

    def pop(self) -> tuple[float, str, Any]:
        """Remove the earliest event, advance ``now`` to it; returns (time, kind, payload)."""
        time, _, _, kind, payload = heapq.heappop(self._heap)
        self.now = time
        return time, kind, payload

    def __len__(self) -> int:
        return len(self._heap)
