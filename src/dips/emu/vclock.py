"""The virtual clock of virtual-time comparisons: an event heap and emulated durations (§13).

Virtual time replaces measured wall time so that a comparison is reproducible bit for bit: an
inner step of cluster i started at virtual time t lasts ``step_s × slowdown_i(t)`` seconds
(:meth:`dips.spec.ClusterConfig.slowdown_at`: constant slowdown × any active transient
factor), and a transfer of b bytes over a link of rate B(t) bits/s
(:meth:`dips.spec.LinkConfig.rate_at`) lasts the time to move 8·b bits through the
piecewise-constant B(t) (§13: per-cluster 10/5/1 Gbit/s links, one that drops from 10 to
1 Gbit/s), plus a fixed latency.
Nothing here reads a clock or trains; the engines in :mod:`dips.emu.virtual` and
:mod:`dips.baselines` call these functions.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

from dips.spec import ClusterConfig, LinkConfig

__all__ = ["EventQueue", "ideal_tokens", "ring_allreduce_s", "step_duration", "transfer_s"]


@dataclass(order=True)
class _Event:
    time: float
    priority: int
    seq: int
    kind: str = field(compare=False)
    payload: Any = field(compare=False, default=None)


class EventQueue:
    """Min-heap of events ordered by (virtual time s, priority, insertion order).

    Equal times are broken by ``priority`` (lower first), then by insertion order, so a run
    never depends on hash order or object identity.
    """

    def __init__(self) -> None:
        self._heap: list[_Event] = []
        self._seq = 0
        self.now = 0.0

    def push(self, time: float, kind: str, payload: Any = None, priority: int = 0) -> None:
        """Schedule ``kind`` at virtual time ``time`` (s). Raises ValueError for a past or non-finite time."""
        if not math.isfinite(time) or time < self.now:
            raise ValueError(f"event {kind!r}: time = {time} is before now = {self.now} or not finite")
        heapq.heappush(self._heap, _Event(time, priority, self._seq, kind, payload))
        self._seq += 1

    def pop(self) -> tuple[float, str, Any]:
        """Remove the earliest event, advance ``now`` to it; returns (time, kind, payload)."""
        ev = heapq.heappop(self._heap)
        self.now = ev.time
        return ev.time, ev.kind, ev.payload

    def __len__(self) -> int:
        return len(self._heap)


def step_duration(cluster: ClusterConfig, t: float, step_s: float) -> float:
    """Emulated seconds of one inner step started at virtual time ``t`` (s) on ``cluster``."""
    return step_s * cluster.slowdown_at(t)


def _link(cluster: ClusterConfig) -> LinkConfig:
    if cluster.link is None:
        raise ValueError(f"cluster {cluster.id!r}: no link; virtual time needs a link rate")
    return cluster.link


def transfer_s(cluster: ClusterConfig, start_s: float, nbytes: float, latency_s: float = 0.0,
               cap_bps: float | None = None) -> float:
    """Seconds to move ``nbytes`` bytes over ``cluster``'s link starting at virtual time ``start_s``.

    Integrates the piecewise-constant rate of ``cluster.link`` (bits/s, its ``schedule``): with
    a constant link it is exactly ``latency_s + 8·nbytes / bps``.  ``cap_bps`` caps the rate
    (bits/s; e.g. the other end of a point-to-point transfer).

    Raises:
        ValueError: negative or non-finite ``nbytes`` / ``start_s``; a cluster without a link.
    """
    if not math.isfinite(nbytes) or nbytes < 0 or not math.isfinite(start_s) or start_s < 0:
        raise ValueError(f"transfer: nbytes = {nbytes}, start_s = {start_s} must be finite and >= 0")
    link = _link(cluster)

    def rate(t: float) -> float:
        bps = link.rate_at(t)
        return min(bps, cap_bps) if cap_bps is not None else bps

    t = start_s + latency_s
    bits = 8.0 * nbytes
    for change in link.schedule:
        if change.at_s <= t:
            continue
        capacity = (change.at_s - t) * rate(t)
        if capacity >= bits:
            break
        bits -= capacity
        t = change.at_s
    return t + bits / rate(t) - start_s


def ring_allreduce_s(clusters: list[ClusterConfig], start_s: float, nbytes: float,
                     latency_s: float = 0.0) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` bytes among ``clusters`` from ``start_s``.

    Each link carries 2(N−1)/N · nbytes (reduce-scatter + all-gather, the bandwidth-optimal
    ring); the slowest link finishes last. One cluster: 0 s.
    """
    n = len(clusters)
    if n <= 1:
        return 0.0
    per_link = 2.0 * (n - 1) / n * nbytes
    return max(transfer_s(c, start_s, per_link, latency_s) for c in clusters)


def ideal_tokens(clusters: list[ClusterConfig], step_s: float, tokens_per_step: int,
                 horizon_s: float) -> int:
    """Tokens that ``clusters`` would consume by ``horizon_s`` training independently (no outer
    communication, no waiting): the weak-scaling ideal of §13/§14."""
    total = 0
    for c in clusters:
        t = 0.0
        while True:
            t += step_duration(c, t, step_s)
            if t > horizon_s:
                break
            total += tokens_per_step
    return total
