"""Tests of the greedy communication schedule (§10 of the seed)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dips.algo.schedule import ScheduleBook, Transfer, greedy_schedule

T = Transfer


def test_hand_example_two_workers_two_followers():
    steps = greedy_schedule([[0, 1], [2, 3]], {0: 0, 1: 1, 2: 0, 3: 1}, 2)
    # step 0: w0 takes f0 (tie -> lowest id), layer 0; w1 finds f0 busy -> f1, layer 3.
    # step 1: the remaining layer of each worker goes to the other follower.
    assert steps == [[T(0, 0, 0), T(1, 3, 1)], [T(0, 1, 1), T(1, 2, 0)]]


def test_hand_example_least_recently_used_rotation():
    steps = greedy_schedule([[0, 1, 2, 3]], {0: 0, 1: 0, 2: 1, 3: 1}, 2)
    # f0 (tie), then f1 (never used), then f0 (used at step 0 < 1), then f1.
    assert steps == [[T(0, 0, 0)], [T(0, 2, 1)], [T(0, 1, 0)], [T(0, 3, 1)]]


def test_last_used_is_honoured_and_not_mutated():
    last_used = {0: -1, 1: -5}
    steps = greedy_schedule([[0, 1]], {0: 0, 1: 1}, 2, last_used)
    assert steps == [[T(0, 1, 1)], [T(0, 0, 0)]]
    assert last_used == {0: -1, 1: -5}


def test_empty_inputs():
    assert greedy_schedule([], {}, 1) == []
    assert greedy_schedule([[], []], {}, 3) == []


@pytest.mark.parametrize(
    "worker_layers,owner,num_followers,last_used,match",
    [
        ([[0], [0]], {0: 0}, 1, None, "layer 0 listed twice"),
        ([[0, 0]], {0: 0}, 1, None, "layer 0 listed twice"),
        ([[0, 1]], {0: 0}, 1, None, "layer 1 of worker 0 has no owner"),
        ([[0]], {0: 2}, 2, None, r"owner\[0\].*2"),
        ([[0]], {0: -1}, 2, None, r"owner\[0\].*-1"),
        ([[0]], {0: 0}, 0, None, "num_followers.*0"),
        ([[0]], {0: 0}, 1, {3: 0}, "last_used key.*3"),
        ([[0]], {0: 0}, 1, {0: 0.5}, r"last_used\[0\].*0.5"),
        ([["a"]], {"a": 0}, 1, None, "non-int layer 'a'"),
    ],
)
def test_validation_errors(worker_layers, owner, num_followers, last_used, match):
    with pytest.raises(ValueError, match=match):
        greedy_schedule(worker_layers, owner, num_followers, last_used)


@st.composite
def push_shapes(draw):
    num_followers = draw(st.integers(1, 5))
    num_workers = draw(st.integers(1, 5))
    num_layers = draw(st.integers(0, 24))
    layer_ids = draw(st.permutations(range(num_layers)))
    worker_layers = [[] for _ in range(num_workers)]
    owner = {}
    for layer in layer_ids:
        worker_layers[draw(st.integers(0, num_workers - 1))].append(layer)
        owner[layer] = draw(st.integers(0, num_followers - 1))
    return worker_layers, owner, num_followers


@settings(max_examples=200, deadline=None)
@given(push_shapes())
def test_schedule_properties(shape):
    worker_layers, owner, num_followers = shape
    steps = greedy_schedule(worker_layers, owner, num_followers)
    flat = [t for step in steps for t in step]
    worker_of = {layer: w for w, layers in enumerate(worker_layers) for layer in layers}

    # Every layer exactly once, from its worker to its owner.
    assert sorted(t.layer for t in flat) == sorted(worker_of)
    for t in flat:
        assert t.worker == worker_of[t.layer] and t.follower == owner[t.layer]

    # No conflicts inside a step, no empty steps, workers in order.
    for step in steps:
        assert step
        assert len({t.worker for t in step}) == len(step)
        assert len({t.follower for t in step}) == len(step)
        assert [t.worker for t in step] == sorted(t.worker for t in step)

    # Per worker and follower, layers go in increasing order.
    sent: dict[tuple[int, int], list[int]] = {}
    for t in flat:
        sent.setdefault((t.worker, t.follower), []).append(t.layer)
    assert all(layers == sorted(layers) for layers in sent.values())

    # Lower bound: one transfer per endpoint per step.
    per_follower = Counter(owner[layer] for layer in worker_of)
    per_worker = [len(layers) for layers in worker_layers]
    assert len(steps) >= max([0, *per_worker, *per_follower.values()])

    # Greedy maximality: a worker left out of a step had every eligible follower busy.
    unsent = {w: set(layers) for w, layers in enumerate(worker_layers)}
    for step in steps:
        busy = {t.follower for t in step}
        active = {t.worker for t in step}
        for w, layers in unsent.items():
            if w not in active:
                assert {owner[layer] for layer in layers} <= busy
        for t in step:
            unsent[t.worker].discard(t.layer)


@settings(max_examples=200, deadline=None)
@given(push_shapes())
def test_each_choice_is_the_least_recently_used_follower_and_earliest_layer(shape):
    """Replays the §10 rule: in every step, worker w (in order) takes the least recently used
    follower among those free in this step that own one of its unsent layers (ties -> lowest
    id), and sends its earliest unsent layer owned by that follower."""
    worker_layers, owner, num_followers = shape
    steps = greedy_schedule(worker_layers, owner, num_followers)
    last = {f: -1 for f in range(num_followers)}
    unsent = [sorted(layers) for layers in worker_layers]
    for k, step in enumerate(steps):
        by_worker = {t.worker: t for t in step}
        busy: set[int] = set()
        for w in range(len(worker_layers)):
            eligible = {owner[layer] for layer in unsent[w]} - busy
            if not eligible:
                assert w not in by_worker
                continue
            f = min(eligible, key=lambda x: (last[x], x))
            layer = min(layer for layer in unsent[w] if owner[layer] == f)
            assert by_worker[w] == T(w, layer, f)
            unsent[w].remove(layer)
            busy.add(f)
            last[f] = k
    assert not any(unsent)


def test_a_new_cluster_schedule_depends_only_on_its_own_layers():
    # Schedules are computed per push request; another cluster's schedule is never recomputed.
    a = greedy_schedule([[0, 1, 2], [3, 4, 5]], {i: i % 3 for i in range(6)}, 3)
    b = greedy_schedule([[0, 1, 2, 3, 4, 5]], {i: i % 3 for i in range(6)}, 3)
    assert greedy_schedule([[0, 1, 2], [3, 4, 5]], {i: i % 3 for i in range(6)}, 3) == a
    assert b != a and len(a) == 3 and len(b) == 6


# ----- across clusters: reserved steps and the ScheduleBook ---------------------------------

def test_reserved_followers_rank_as_just_used():
    # One worker with a layer on each of 4 followers; another cluster uses f0 at step 0, f1 at
    # step 1, f2 at step 2, f3 at step 3. Step 0: f0 is in use -> f1 (lowest of the unused);
    # step 1: f1 just used (own), f0 last at 0, f2/f3 never -> f2; step 2: f2 reserved,
    # f3 never -> f3; step 3: f0 (step 0) < f1 (1) < f3 (reserved now) -> f0.
    owner = {0: 0, 1: 1, 2: 2, 3: 3}
    steps = greedy_schedule([[0, 1, 2, 3]], owner, 4, None, [{0}, {1}, {2}, {3}])
    assert steps == [[T(0, 1, 1)], [T(0, 2, 2)], [T(0, 3, 3)], [T(0, 0, 0)]]


def test_reserved_is_a_preference_not_a_ban():
    # The only eligible follower is reserved at every step: it is still used (progress).
    steps = greedy_schedule([[0, 1]], {0: 0, 1: 0}, 2, None, [{0}, {0}])
    assert steps == [[T(0, 0, 0)], [T(0, 1, 0)]]


def test_reserved_validation():
    with pytest.raises(ValueError, match=r"reserved\[1\].*7"):
        greedy_schedule([[0]], {0: 0}, 2, None, [set(), {7}])


def test_book_second_cluster_of_a_round_starts_on_other_followers():
    """Hand-checked: 2 stage workers x 4 followers, stage 0 holds layers 0-3 (on f0, f0, f1,
    f1), stage 1 holds 4-7 (on f2, f2, f3, f3).

    Cluster A (first of round 0, no history): step 0: w0 -> f0 (tie -> lowest), w1 -> f2;
    step 1: w0 -> f1 (never used), w1 -> f3; step 2: w0 -> f0, w1 -> f2; step 3: f1, f3.
    Cluster B (same round): at step 0, A uses f0 and f2 -> w0 takes f1, w1 takes f3; step 1
    (A on f1, f3): w0 -> f0, w1 -> f2; and so on: B's links are never A's at the same step."""
    book = ScheduleBook(4)
    workers = [[0, 1, 2, 3], [4, 5, 6, 7]]
    owner = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2, 6: 3, 7: 3}
    a = book.schedule(0, workers, owner)
    assert a == [[T(0, 0, 0), T(1, 4, 2)], [T(0, 2, 1), T(1, 6, 3)],
                 [T(0, 1, 0), T(1, 5, 2)], [T(0, 3, 1), T(1, 7, 3)]]
    b = book.schedule(0, workers, owner)
    assert b == [[T(0, 2, 1), T(1, 6, 3)], [T(0, 0, 0), T(1, 4, 2)],
                 [T(0, 3, 1), T(1, 7, 3)], [T(0, 1, 0), T(1, 5, 2)]]
    for sa, sb in zip(a, b):
        assert not {t.follower for t in sa} & {t.follower for t in sb}


def test_book_carries_history_into_the_next_round():
    # One worker, layers 0..2 on f0..f2. Round 0: A uses f0, f1, f2 at steps 0, 1, 2 (all
    # never used: lowest id first). Round 1: history f0 = -3, f1 = -2, f2 = -1 -> the new
    # cluster starts on f0 again (least recently used), not on a follower just released.
    book = ScheduleBook(3)
    owner = {0: 0, 1: 1, 2: 2}
    assert book.schedule(0, [[0, 1, 2]], owner) == [[T(0, 0, 0)], [T(0, 1, 1)], [T(0, 2, 2)]]
    assert book.schedule(1, [[1, 2]], owner) == [[T(0, 1, 1)], [T(0, 2, 2)]]
    assert book.last_used() == {0: -3, 1: -2, 2: -1}
    # Round 2: f1, f2 were used in round 1 (steps 3, 4), f0 last at step 0 -> f0 first.
    assert book.schedule(2, [[0, 1, 2]], owner) == [[T(0, 0, 0)], [T(0, 1, 1)], [T(0, 2, 2)]]
    assert book.last_used() == {0: -5, 1: -2, 2: -1}


def test_book_follower_count_grows_and_validates():
    book = ScheduleBook(1)
    assert book.schedule(0, [[0]], {0: 1}, num_followers=2) == [[T(0, 0, 1)]]
    with pytest.raises(ValueError, match="num_followers"):
        ScheduleBook(0)
    with pytest.raises(ValueError, match="no owner"):
        book.schedule(0, [[5]], {0: 0})


@settings(max_examples=100, deadline=None)
@given(push_shapes(), st.integers(1, 4))
def test_book_schedules_keep_the_schedule_properties(shape, clusters):
    """Every cluster's schedule from the book still sends each layer once, from its worker to
    its owner, with no worker or follower twice in a step."""
    worker_layers, owner, num_followers = shape
    book = ScheduleBook(num_followers)
    worker_of = {layer: w for w, layers in enumerate(worker_layers) for layer in layers}
    for _ in range(clusters):
        steps = book.schedule(0, worker_layers, owner)
        flat = [t for step in steps for t in step]
        assert sorted(t.layer for t in flat) == sorted(worker_of)
        for t in flat:
            assert t.worker == worker_of[t.layer] and t.follower == owner[t.layer]
        for step in steps:
            assert step
            assert len({t.worker for t in step}) == len(step) == len({t.follower for t in step})
