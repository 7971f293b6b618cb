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
"""

from __future__ import annotations

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


def _validate(
    worker_layers: list[list[int]],
    owner: dict[int, int],
    num_followers: int,
    last_used: dict[int, int] | None,
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


def greedy_schedule(
    worker_layers: list[list[int]],
    owner: dict[int, int],
    num_followers: int,
    last_used: dict[int, int] | None = None,
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

    Returns:
        Steps in order; each step is a list of :class:`Transfer` sorted by worker, with no
        worker and no follower twice. Every listed layer appears exactly once overall. Empty
        when no worker holds a layer.

    Raises:
        ValueError: num_followers < 1, a layer listed twice, a layer without an owner or with
            an owner out of range, or a malformed ``last_used`` (naming the value).
    """
    _validate(worker_layers, owner, num_followers, last_used)
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
