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
:class:`dips.sim.events.FastQueue`: one event per follower NIC direction, for its flow that
ends first (an allocation makes the group's earlier event stale: its generation is old).
Flows of one NIC direction over one link share a rate class timed by one service counter
(:class:`Network`), so a run of a thousand clusters stays fast. A NIC's completion event is
pushed again only when its rates or its first flow to end changed (an unchanged allocation keeps
its pending event).

Identical concurrent jobs are merged (``Job.merge``, the pulls): the clusters of one type whose
verdicts come out together start the same pull plan over the same link at the same instant, so
their flows move in lockstep; they are carried as one set of flows of ``weight`` k (k flows in
the max-min share, k times the bytes). A cluster lost meanwhile leaves the set (its weight
drops, the others go on). The rates, and so every time, are those of k separate flows; only
the order of events at one instant can differ (one completion instead of k).

A :class:`Job` is one cluster's push or pull: per stage worker, its transfers in order. A push
follows the leader's §10 schedule (:class:`dips.algo.schedule.ScheduleBook`); with ``exclusive``
(stage workers in one process, :class:`dips.roles.cluster._Links`) two workers of one cluster
never send to the same follower at once: a worker whose next follower is in use waits for it
(stage workers on separate hosts have no such lock). A pull fetches
each follower's layers of the stage in one transfer, one follower after another (as
:meth:`dips.roles.cluster.StageWorker.pull`). Each transfer starts ``latency_s`` after it is due.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from dips.sim.events import FastQueue
from dips.sim.followers import FollowerLoad
from dips.spec import LinkConfig

__all__ = ["Flow", "Job", "Network"]

#: Merge identical concurrent jobs (module docstring); tests turn it off to compare.
MERGE_JOBS = True
#: Keep a NIC's pending completion event while its allocation is unchanged; tests turn it off.
KEEP_PENDING = True


@dataclass(eq=False)
class Flow:
    """One transfer of ``total_bits`` between a stage worker of ``job`` and ``follower`` in
    ``direction``, over ``link``, for ``weight`` identical jobs (``job`` and its riders); it
    ends when its rate class's service counter reaches ``finish`` (bits: the counter when it
    started + its bits)."""

    fid: int
    job: "Job"
    stage: int
    follower: int
    direction: str
    total_bits: float
    link: LinkConfig
    weight: int = 1
    finish: float = 0.0
    alive: bool = True
    cls: "_Class | None" = None


@dataclass(eq=False)
class _Class:
    """The flows of one NIC direction over one link (one rate class): under max-min sharing
    they always move at the same ``rate`` (bits/s), so one service counter ``served`` (bits
    each has moved since the class began) times them all; ``heap`` orders them by finish
    (dead entries, of cancelled jobs, are skipped lazily); ``count``: the live flows' weights."""

    link: LinkConfig
    order: int
    rate: float = 0.0
    served: float = 0.0
    count: int = 0
    heap: list[tuple[float, int, Flow]] = field(default_factory=list)

    def head(self) -> tuple[float, int, Flow] | None:
        """The live flow that ends first, dropping dead ones from the top."""
        heap = self.heap
        while heap and not heap[0][2].alive:
            heapq.heappop(heap)
        return heap[0] if heap else None


class Network:
    """The flows in progress and the follower NICs they share.

    Flows of one NIC direction over the same link form a rate class (every cluster of a type
    shares its :class:`LinkConfig`): the water-filling runs over classes, not flows, and each
    class keeps a heap of its flows by finishing service, so an event costs O(classes +
    log flows) instead of O(flows) (exactly the same max-min rates: flows of equal link rate get
    equal shares).

    Args:
        loads: one :class:`FollowerLoad` per follower (NIC rates and bytes are reported there).
        nic_bps: each follower NIC's rate per direction, bits/s.
        queue: the simulator's event queue ("flow_start" and "flow_done" events are pushed).
    """

    def __init__(self, loads: list[FollowerLoad], nic_bps: float, queue: FastQueue) -> None:
        self.loads, self.nic_bps, self.queue = loads, nic_bps, queue
        self.groups: dict[tuple[int, str], dict[int, _Class]] = {
            (f, d): {} for f in range(len(loads)) for d in ("in", "out")}
        self.last: dict[tuple[int, str], float] = {k: 0.0 for k in self.groups}
        self.gen: dict[tuple[int, str], int] = {k: 0 for k in self.groups}
        #: key -> ((class order, rate) of each class, fid) of its pending completion event
        #: (None: none).
        self.pending: dict[tuple[int, str], tuple[tuple[tuple[int, float], ...], int] | None] = {
            k: None for k in self.groups}
        self.total: dict[tuple[int, str], float] = {k: 0.0 for k in self.groups}
        self.down: set[int] = set()
        self.merged = 0  # jobs carried by an identical one (see the module docstring)
        self._next_id = 0
        self._twins: dict[Any, Job] = {}
        self._twins_t = -1.0

    def twin(self, t: float, job: "Job") -> "Job | None":
        """A mergeable job begun at ``t`` with ``job``'s plan, link, latency and direction that
        ``job`` can ride (its flows carry one more weight from now); None: ``job`` runs alone
        (and may be ridden by the next one)."""
        if t != self._twins_t:
            self._twins, self._twins_t = {}, t
        key = (job.direction, id(job.link), job.latency_s, job.exclusive,
               tuple(tuple(p) for p in job.plan))
        other = self._twins.get(key)
        if not MERGE_JOBS or other is None or other.interest == 0:
            self._twins[key] = job
            return None
        other.riders.append(job)
        self.merged += 1
        self._reweight(t, other, +1)
        return other

    def launch(self, t: float, job: "Job", stage: int, follower: int, direction: str,
               nbytes: float, delay_s: float) -> Flow:
        """A flow of ``nbytes`` bytes (per job carried) that starts ``delay_s`` seconds after
        ``t``."""
        self._next_id += 1
        flow = Flow(self._next_id, job, stage, follower, direction, 8.0 * nbytes, job.link,
                    job.interest)
        job.flows.add(flow)
        if delay_s > 0:
            self.queue.push(t + delay_s, "flow_start", flow)
        else:
            self.start(t, flow)
        return flow

    def start(self, t: float, flow: Flow) -> None:
        """Flow ``flow`` begins moving bits at ``t`` (ignored if its jobs were cancelled)."""
        if not flow.alive:
            return
        key = (flow.follower, flow.direction)
        self._progress(key, t)
        group = self.groups[key]
        cls = group.get(id(flow.link))
        if cls is None:
            cls = group[id(flow.link)] = _Class(flow.link, len(group))
        flow.cls = cls
        flow.finish = cls.served + flow.total_bits
        heapq.heappush(cls.heap, (flow.finish, flow.fid, flow))
        cls.count += flow.weight
        self._allocate(key, t)

    def finish(self, t: float, flow: Flow, gen: int, key: tuple[int, str]) -> Flow | None:
        """Complete ``flow`` at ``t`` if the NIC ``key``'s allocation ``gen`` is still current
        (it is then the first of its class to end); returns it."""
        if self.gen[key] != gen or not flow.alive:
            return None
        self._progress(key, t)
        cls = flow.cls
        top = cls.head()
        if top is None or top[2] is not flow:
            return None
        heapq.heappop(cls.heap)
        cls.count -= flow.weight
        flow.alive = False
        flow.job.flows.discard(flow)
        self.pending[key] = None
        self.loads[key[0]].moved(key[1], flow.weight * flow.total_bits / 8.0)
        self._allocate(key, t)
        return flow

    def cancel(self, t: float, job: "Job") -> None:
        """``job``'s cluster failed at ``t``: it no longer counts in its flows (they stop when
        no job rides them any more)."""
        if job.cancelled:
            return
        job.cancelled = True
        carrier = job.carrier or job
        if carrier is not job:
            carrier.riders.remove(job)
            job.carrier = None
        self._reweight(t, carrier, -1)

    def _reweight(self, t: float, job: "Job", delta: int) -> None:
        """``job``'s flows carry ``delta`` more jobs from ``t`` on (dying at weight 0)."""
        touched = []
        for flow in list(job.flows):
            flow.weight += delta
            if flow.weight <= 0:
                flow.alive = False
                job.flows.discard(flow)
            if flow.cls is not None:
                key = (flow.follower, flow.direction)
                if key not in touched:
                    self._progress(key, t)
                    touched.append(key)
                flow.cls.count += delta
        for key in touched:
            self.pending[key] = None  # the allocation changed
            self._allocate(key, t)

    def set_down(self, t: float, follower: int, down: bool) -> None:
        """Follower ``follower`` stops (``down``) or resumes serving at ``t``: its flows stall
        at rate 0 (their bits so far kept) until it resumes."""
        if (follower in self.down) == down:
            return
        for d in ("in", "out"):
            self._progress((follower, d), t)
        self.down.symmetric_difference_update({follower})
        for d in ("in", "out"):
            self.pending[(follower, d)] = None
            self._allocate((follower, d), t)

    def relink(self, t: float) -> None:
        """Re-share every NIC at ``t`` (a link's rate changed)."""
        for key, group in self.groups.items():
            if any(c.count for c in group.values()):
                self._progress(key, t)
                self.pending[key] = None
                self._allocate(key, t)

    def _progress(self, key: tuple[int, str], t: float) -> None:
        dt = t - self.last[key]
        if dt > 0:
            for cls in self.groups[key].values():
                if cls.count:
                    cls.served += cls.rate * dt
        self.last[key] = t

    def _allocate(self, key: tuple[int, str], t: float) -> None:
        """Water-filling of the follower NIC ``key`` among its rate classes (module docstring);
        the completion event is pushed again only if a rate or the first flow changed."""
        live = [(c.link.rate_at(t) if c.link.schedule else c.link.bps, c.order, c)
                for c in self.groups[key].values() if c.count]
        if len(live) > 1:
            live.sort()
        left, total = (0.0 if key[0] in self.down else self.nic_bps), 0.0
        n = 0
        for _, _, c in live:
            n += c.count
        first: tuple[float, int, Flow] | None = None
        rates = []
        for link_bps, order, c in live:
            rate = c.rate = min(link_bps, left / n)
            rates.append((order, rate))
            left -= rate * c.count
            n -= c.count
            total += rate * c.count
            if rate <= 0:
                continue  # a follower that is down: nothing moves, nothing ends
            top = c.head()
            end = t + max(0.0, top[0] - c.served) / rate
            if first is None or (end, top[1]) < first[:2]:
                first = (end, top[1], top[2])
        if total != self.total[key]:
            self.total[key] = total
            self.loads[key[0]].nic(key[1], total, t)
        state = (tuple(rates), first[1] if first is not None else -1)
        if KEEP_PENDING and state == self.pending[key]:
            return  # the pending event still holds: same rates, same first flow
        self.gen[key] += 1
        self.pending[key] = state if first is not None else None
        if first is not None:
            self.queue.push(first[0], "flow_done", (first[2], self.gen[key], key))


@dataclass(eq=False)
class Job:
    """One cluster's push ("in") or pull ("out"): ``plan[s]`` is stage worker s's transfers in
    order, ``(follower, bytes)`` or ``(follower, bytes, n)`` for n transfers sent as one flow
    (it starts after their n setups of ``latency_s``); ``exclusive``: two workers never use one follower at once;
    ``on_done(t)`` runs when every worker finished; ``merge``: it may ride an identical job
    begun at the same instant (``carrier``; the carrier's ``riders`` are done when it is)."""

    net: Network
    cluster: str
    direction: str
    plan: list[list[tuple[Any, ...]]]
    link: LinkConfig
    latency_s: float
    exclusive: bool
    on_done: Callable[[float], None]
    merge: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    cancelled: bool = False
    carrier: "Job | None" = None
    riders: list["Job"] = field(default_factory=list)
    flows: set[Flow] = field(default_factory=set)
    _pos: list[int] = field(default_factory=list)
    _busy: set[int] = field(default_factory=set)
    _waiting: dict[int, deque[int]] = field(default_factory=dict)
    _left: int = 0

    @property
    def interest(self) -> int:
        """Jobs its flows carry: itself unless cancelled, and its riders."""
        return (not self.cancelled) + len(self.riders)

    def begin(self, t: float) -> None:
        """Start every stage worker at ``t`` (or ride an identical job begun at ``t``)."""
        if self.merge:
            self.carrier = self.net.twin(t, self)
            if self.carrier is not None:
                return
        self._pos = [0] * len(self.plan)
        self._left = len(self.plan)
        for s in range(len(self.plan)):
            self._next(s, t)

    def _next(self, s: int, t: float) -> None:
        if self._pos[s] == len(self.plan[s]):
            self._left -= 1
            if self._left == 0:
                if not self.cancelled:
                    self.on_done(t)
                for rider in list(self.riders):
                    rider.on_done(t)
            return
        if not self.interest:
            return
        follower, nbytes, *merged = self.plan[s][self._pos[s]]
        if self.exclusive and follower in self._busy:
            self._waiting.setdefault(follower, deque()).append(s)
            return
        self._busy.add(follower)
        self.net.launch(t, self, s, follower, self.direction, nbytes,
                        self.latency_s * (merged[0] if merged else 1))

    def flow_done(self, t: float, flow: Flow) -> None:
        """Worker ``flow.stage`` finished a transfer at ``t``: it and any worker waiting for the
        follower move on."""
        self._pos[flow.stage] += 1
        self._busy.discard(flow.follower)
        waiting = self._waiting.get(flow.follower)
        if waiting:
            self._next(waiting.popleft(), t)
        self._next(flow.stage, t)
