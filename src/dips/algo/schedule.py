"""Greedy communication schedule for one push (§10 of the seed).

A cluster has several stage workers (one per PP stage) and the model's layers are spread over
several followers, so a push is many-to-many. The leader splits it into communication steps;
in one step every stage worker sends at most one layer and every follower receives at most one
layer, so the links of a step run in parallel without two transfers sharing an endpoint.

Greedy rule (§10): in each step, walk the workers in order; for worker w the eligible followers
are those owning one of w's unsent layers and not yet used in this step; pick the least recently
used one (ties -> lowest follower id) and send w's earliest (lowest-numbered) unsent layer owned
by it. Repeat until every layer is sent exactly once. Spreading work over the least recently
used followers keeps many cross-cluster links busy at once. A new cluster's schedule needs no
global re-optimization, which matters because clusters arrive asynchronously.

Across clusters (:class:`ScheduleBook`): the clusters admitted into one round push at the same
time, so step k of each runs alongside step k of the others. The book keeps every follower's
use on one timeline: a new cluster's step k sees the followers that earlier clusters of the
round use in their step k as the most recently used ones (``reserved``), and the rounds before
as older history (``last_used``). Its schedule is computed alone; the others' are never
recomputed.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Transfer:
    """One (stage worker, layer, follower) pair of a communication step (§10 of the seed).

    worker: index into ``worker_layers``; layer: layer id; follower: follower id (owner).
    """

    worker: int
    layer: int
    follower: int


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _valid_fast(worker_layers: list[list[int]], owner: dict[int, int], num_followers: int,
                last_used: dict[int, int] | None, reserved: Sequence[Collection[int]]) -> bool:
    """True if :func:`_validate` would accept these arguments with plain ints only (no
    call per element: the leader schedules every push of a round of hundreds); False means
    "let :func:`_validate` look" (it accepts int subclasses too, and names what is wrong)."""
    if type(num_followers) is not int or num_followers < 1:
        return False
    seen: set[int] = set()
    count = 0
    for layers in worker_layers:
        for layer in layers:
            f = owner.get(layer) if type(layer) is int else None
            if type(f) is not int or not 0 <= f < num_followers:
                return False
            seen.add(layer)
            count += 1
    if len(seen) != count:
        return False
    for f, step in (last_used or {}).items():
        if type(f) is not int or type(step) is not int or not 0 <= f < num_followers:
            return False
    for fs in reserved:
        for f in fs:
            if type(f) is not int or not 0 <= f < num_followers:
                return False
    return True


def _validate(
    worker_layers: list[list[int]],
    owner: dict[int, int],
    num_followers: int,
    last_used: dict[int, int] | None,
    reserved: Sequence[Collection[int]] = (),
) -> None:
    if not _is_int(num_followers) or num_followers < 1:
        raise ValueError(f"num_followers must be an int >= 1, got {num_followers!r}")
    seen: dict[int, int] = {}
    for w, layers in enumerate(worker_layers):
        for layer in layers:
            if not _is_int(layer):
                raise ValueError(f"worker_layers[{w}] holds a non-int layer {layer!r}")
            if layer in seen:
                raise ValueError(f"layer {layer} listed twice (workers {seen[layer]} and {w})")
            seen[layer] = w
            if layer not in owner:
                raise ValueError(f"layer {layer} of worker {w} has no owner")
            f = owner[layer]
            if not _is_int(f) or not 0 <= f < num_followers:
                raise ValueError(
                    f"owner[{layer}] must be a follower id in [0, {num_followers}), got {f!r}"
                )
    for f, step in (last_used or {}).items():
        if not _is_int(f) or not 0 <= f < num_followers:
            raise ValueError(
                f"last_used key must be a follower id in [0, {num_followers}), got {f!r}"
            )
        if not _is_int(step):
            raise ValueError(f"last_used[{f}] must be an int step index, got {step!r}")
    for k, fs in enumerate(reserved):
        for f in fs:
            if not _is_int(f) or not 0 <= f < num_followers:
                raise ValueError(
                    f"reserved[{k}] must hold follower ids in [0, {num_followers}), got {f!r}"
                )


def greedy_schedule(
    worker_layers: list[list[int]],
    owner: dict[int, int],
    num_followers: int,
    last_used: dict[int, int] | None = None,
    reserved: Sequence[Collection[int]] = (),
) -> list[list[Transfer]]:
    """Build the communication steps of one push with the greedy rule of §10.

    Args:
        worker_layers: worker_layers[w] = layer ids (ints) held by stage worker w; a layer may
            appear in at most one worker; a worker may hold none.
        owner: layer id -> follower id in [0, num_followers); must cover every listed layer.
        num_followers: number of followers (int >= 1).
        last_used: follower id -> step index when it was last used; absent means -1 (never).
            Lower means less recently used. This schedule numbers its own steps from 0, so
            history from an earlier push should be passed as negative indices. Read only.
        reserved: reserved[k] = followers that transfers running alongside this push (other
            clusters' schedules) use in their step k. At step k each of them counts as used at
            step k, i.e. most recently: it is picked only when no other eligible follower is
            left (a preference, not a ban, so every step still makes progress). Read only.

    Returns:
        Steps in order; each step is a list of :class:`Transfer` sorted by worker, with no
        worker and no follower twice. Every listed layer appears exactly once overall. Empty
        when no worker holds a layer.

    Raises:
        ValueError: num_followers < 1, a layer listed twice, a layer without an owner or with
            an owner out of range, or a malformed ``last_used`` / ``reserved`` (naming the
            value).
    """
    if not _valid_fast(worker_layers, owner, num_followers, last_used, reserved):
        _validate(worker_layers, owner, num_followers, last_used, reserved)
    lru = {f: -1 for f in range(num_followers)}
    lru.update(last_used or {})
    # pending[w][f] = w's unsent layers owned by f, lowest first (popped from the end).
    pending: list[dict[int, list[int]]] = []
    for layers in worker_layers:
        by_follower: dict[int, list[int]] = {}
        for layer in sorted(layers, reverse=True):
            by_follower.setdefault(owner[layer], []).append(layer)
        pending.append(by_follower)
    remaining = sum(len(layers) for layers in worker_layers)

    steps: list[list[Transfer]] = []
    while remaining:
        step_index = len(steps)
        if step_index < len(reserved):
            for f in reserved[step_index]:
                lru[f] = step_index
        busy: set[int] = set()
        step: list[Transfer] = []
        for w, by_follower in enumerate(pending):
            eligible = [f for f in by_follower if f not in busy]
            if not eligible:
                continue
            f = min(eligible, key=lambda fid: (lru[fid], fid))
            layer = by_follower[f].pop()
            if not by_follower[f]:
                del by_follower[f]
            busy.add(f)
            lru[f] = step_index
            step.append(Transfer(worker=w, layer=layer, follower=f))
        # The first worker with unsent layers always finds every follower free: progress.
        remaining -= len(step)
        steps.append(step)
    return steps


class ScheduleBook:
    """The leader's record of follower use across clusters and rounds (§10 of the seed).

    :meth:`schedule` builds one cluster's push schedule with :func:`greedy_schedule`, passing
    (1) as ``reserved`` the followers used at each step by the clusters already scheduled in
    the same round (they push concurrently, from the same start), and (2) as ``last_used``
    every follower's last use in earlier rounds, on one step timeline: round r's step 0 comes
    after the last step of every earlier round. It then records the new schedule; earlier
    schedules are never recomputed. Not thread-safe (the leader holds its lock). Memory: one
    set per step of the current round plus one int per follower.

    Args:
        num_followers: followers are ids in [0, num_followers) (int >= 1); may grow later.

    Raises:
        ValueError: num_followers < 1.
    """

    def __init__(self, num_followers: int = 1) -> None:
        if not _is_int(num_followers) or num_followers < 1:
            raise ValueError(f"num_followers must be an int >= 1, got {num_followers!r}")
        self.num_followers = num_followers
        self.round: int | None = None
        self.base = 0  # timeline step of the current round's step 0
        self.last: dict[int, int] = {}  # follower -> timeline step of its last use (rounds before)
        self.steps: list[set[int]] = []  # followers in use at each step of the current round

    def _open(self, rnd: int) -> None:
        for k, fs in enumerate(self.steps):
            for f in fs:
                self.last[f] = self.base + k
        self.base += len(self.steps)
        self.steps = []
        self.round = rnd

    def last_used(self) -> dict[int, int]:
        """``last_used`` for :func:`greedy_schedule` at the current round's step 0: every
        follower's last use before this round, as a negative step (-1: the step just before;
        a follower never used ranks below all used ones)."""
        return {f: self.last.get(f, -1) - self.base for f in range(self.num_followers)}

    def schedule(self, rnd: int, worker_layers: list[list[int]], owner: dict[int, int],
                 num_followers: int | None = None) -> list[list[Transfer]]:
        """The schedule of one cluster admitted into round ``rnd`` (see the class docstring).

        Args:
            rnd: the round (outer step) the push belongs to; a new value starts a new round.
            worker_layers, owner: as for :func:`greedy_schedule`.
            num_followers: the current follower count, if it grew (it never shrinks).

        Raises:
            ValueError: as :func:`greedy_schedule` (nothing is recorded then).
        """
        if num_followers is not None and num_followers > self.num_followers:
            self.num_followers = num_followers
        if rnd != self.round:
            self._open(rnd)
        steps = greedy_schedule(worker_layers, owner, self.num_followers, self.last_used(),
                                self.steps)
        for k, step in enumerate(steps):
            if k == len(self.steps):
                self.steps.append(set())
            self.steps[k].update(t.follower for t in step)
        return steps
