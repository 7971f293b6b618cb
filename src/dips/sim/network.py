"""The data plane of a simulated run as a fluid model: stage workers ⇄ follower NICs (§10).

Every transfer is one *flow* between one stage worker and one follower, in one direction: "in"
(a push: the stage worker sends a layer to its owner) or "out" (a pull: the follower sends the
stage's layers it owns). A flow is limited by its stage worker's link (:class:`LinkConfig`,
bits/s, which may change on a schedule) and shares its follower's NIC (``nic_bps`` per
direction, full duplex) with the other flows of that follower and direction. A stage worker
runs one flow at a time, so the only shared resource of a flow is one follower NIC direction and
the max-min fair allocation is a water-filling per follower and direction: flows sorted by their
link's rate, each gets min(its rate, what is left / flows left). Rates change only when a flow
starts or ends or a link's rate changes; each flow's completion is an event of the simulator's
:class:`dips.emu.vclock.EventQueue` (a stale one is recognised by its generation).

A :class:`Job` is one cluster's push or pull: per stage worker, its transfers in order. A push
follows the leader's §10 schedule (:class:`dips.algo.schedule.ScheduleBook`); with ``exclusive``
(stage workers in one process, :class:`dips.roles.cluster._Links`) two workers of one cluster
never send to the same follower at once: a worker whose next follower is in use waits for it
(stage workers on separate hosts have no such lock). A pull fetches
each follower's layers of the stage in one transfer, one follower after another (as
:meth:`dips.roles.cluster.StageWorker.pull`). Each transfer starts ``latency_s`` after it is due.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from dips.emu.vclock import EventQueue
from dips.sim.followers import FollowerLoad
from dips.spec import LinkConfig

__all__ = ["Flow", "Job", "Network"]


@dataclass(eq=False)
class Flow:
    """One transfer: ``bits`` left (of ``total_bits``) between a stage worker of ``job`` and
    ``follower`` in ``direction``; ``rate`` bits/s since its last change; ``gen`` counts the
    changes (a completion event of an older generation is stale)."""

    fid: int
    job: "Job"
    stage: int
    follower: int
    direction: str
    total_bits: float
    link: LinkConfig
    bits: float = 0.0
    rate: float = 0.0
    gen: int = 0


class Network:
    """The flows in progress and the follower NICs they share.

    Args:
        loads: one :class:`FollowerLoad` per follower (NIC rates and bytes are reported there).
        nic_bps: each follower NIC's rate per direction, bits/s.
        queue: the simulator's event queue ("flow_start" and "flow_done" events are pushed).
    """

    def __init__(self, loads: list[FollowerLoad], nic_bps: float, queue: EventQueue) -> None:
        self.loads, self.nic_bps, self.queue = loads, nic_bps, queue
        self.groups: dict[tuple[int, str], dict[int, Flow]] = {
            (f, d): {} for f in range(len(loads)) for d in ("in", "out")}
        self.last: dict[tuple[int, str], float] = {k: 0.0 for k in self.groups}
        self._next_id = 0

    def launch(self, t: float, job: "Job", stage: int, follower: int, direction: str,
               nbytes: float, delay_s: float) -> Flow:
        """A flow of ``nbytes`` bytes that starts ``delay_s`` seconds after ``t``."""
        self._next_id += 1
        flow = Flow(self._next_id, job, stage, follower, direction, 8.0 * nbytes, job.link,
                    bits=8.0 * nbytes)
        if delay_s > 0:
            self.queue.push(t + delay_s, "flow_start", flow)
        else:
            self.start(t, flow)
        return flow

    def start(self, t: float, flow: Flow) -> None:
        """Flow ``flow`` begins moving bits at ``t`` (ignored if its job was cancelled)."""
        if flow.job.cancelled:
            return
        key = (flow.follower, flow.direction)
        self._progress(key, t)
        self.groups[key][flow.fid] = flow
        self._allocate(key, t)

    def finish(self, t: float, fid: int, gen: int, follower: int, direction: str) -> Flow | None:
        """Complete flow ``fid`` at ``t`` if generation ``gen`` is still current; returns it."""
        key = (follower, direction)
        flow = self.groups[key].get(fid)
        if flow is None or flow.gen != gen:
            return None
        self._progress(key, t)
        del self.groups[key][fid]
        flow.bits = 0.0
        self.loads[follower].moved(direction, flow.total_bits / 8.0)
        self._allocate(key, t)
        return flow

    def cancel(self, t: float, job: "Job") -> None:
        """Drop every flow of ``job`` at ``t`` (its cluster failed)."""
        job.cancelled = True
        for key, group in self.groups.items():
            mine = [fid for fid, f in group.items() if f.job is job]
            if mine:
                self._progress(key, t)
                for fid in mine:
                    del group[fid]
                self._allocate(key, t)

    def relink(self, t: float) -> None:
        """Re-share every NIC at ``t`` (a link's rate changed)."""
        for key, group in self.groups.items():
            if group:
                self._progress(key, t)
                self._allocate(key, t)

    def _progress(self, key: tuple[int, str], t: float) -> None:
        dt = t - self.last[key]
        if dt > 0:
            for f in self.groups[key].values():
                f.bits = max(0.0, f.bits - f.rate * dt)
        self.last[key] = t

    def _allocate(self, key: tuple[int, str], t: float) -> None:
        """Water-filling of the follower NIC ``key`` among its flows (module docstring)."""
        flows = sorted(self.groups[key].values(), key=lambda f: (f.link.rate_at(t), f.fid))
        left, total = self.nic_bps, 0.0
        for i, f in enumerate(flows):
            rate = min(f.link.rate_at(t), left / (len(flows) - i))
            left -= rate
            total += rate
            if rate != f.rate:
                f.rate, f.gen = rate, f.gen + 1
                self.queue.push(t + f.bits / rate, "flow_done",
                                (f.fid, f.gen, f.follower, f.direction))
        self.loads[key[0]].nic(key[1], total, t)


@dataclass(eq=False)
class Job:
    """One cluster's push ("in") or pull ("out"): ``plan[s]`` is stage worker s's transfers in
    order, ``(follower, bytes)``; ``exclusive``: two workers never use one follower at once;
    ``on_done(t)`` runs when every worker finished."""

    net: Network
    cluster: str
    direction: str
    plan: list[list[tuple[int, float]]]
    link: LinkConfig
    latency_s: float
    exclusive: bool
    on_done: Callable[[float], None]
    info: dict[str, Any] = field(default_factory=dict)
    cancelled: bool = False
    _pos: list[int] = field(default_factory=list)
    _busy: set[int] = field(default_factory=set)
    _waiting: dict[int, deque[int]] = field(default_factory=dict)
    _left: int = 0

    def begin(self, t: float) -> None:
        """Start every stage worker at ``t``."""
        self._pos = [0] * len(self.plan)
        self._left = len(self.plan)
        for s in range(len(self.plan)):
            self._next(s, t)

    def _next(self, s: int, t: float) -> None:
        if self._pos[s] == len(self.plan[s]):
            self._left -= 1
            if self._left == 0 and not self.cancelled:
                self.on_done(t)
            return
        follower, nbytes = self.plan[s][self._pos[s]]
        if self.exclusive and follower in self._busy:
            self._waiting.setdefault(follower, deque()).append(s)
            return
        self._busy.add(follower)
        self.net.launch(t, self, s, follower, self.direction, nbytes, self.latency_s)

    def flow_done(self, t: float, flow: Flow) -> None:
        """Worker ``flow.stage`` finished a transfer at ``t``: it and any worker waiting for the
        follower move on."""
        self._pos[flow.stage] += 1
        self._busy.discard(flow.follower)
        waiting = self._waiting.get(flow.follower)
        if waiting:
            self._next(waiting.popleft(), t)
        self._next(flow.stage, t)
