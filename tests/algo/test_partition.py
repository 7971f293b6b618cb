"""Tests of contiguous layer ownership (§10 of the seed)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dips.algo.partition import min_max_part_sum, partition_contiguous


def brute_force(sizes: list[int], parts: int) -> int:
    """Smallest max part sum over every split into `parts` non-empty contiguous runs."""
    n = len(sizes)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


def check_cover(ranges: list[range], n: int, parts: int) -> None:
    assert len(ranges) == parts
    assert all(len(r) > 0 and r.step == 1 for r in ranges)
    assert [i for r in ranges for i in r] == list(range(n))


def test_hand_example():
    # Embedding-heavy first layer: it gets its own follower.
    sizes = [10, 2, 2, 2, 2, 2]
    ranges = partition_contiguous(sizes, 2)
    assert ranges == [range(0, 1), range(1, 6)]
    assert partition_contiguous([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert partition_contiguous([5, 5, 5], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert partition_contiguous([7], 1) == [range(0, 1)]


def test_zero_sizes_still_give_non_empty_parts():
    ranges = partition_contiguous([0, 0, 0, 0, 0], 3)
    check_cover(ranges, 5, 3)
    ranges = partition_contiguous([9, 0, 0, 0], 4)
    check_cover(ranges, 4, 4)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.data())
def test_optimal_and_covering_versus_brute_force(sizes, data):
    parts = data.draw(st.integers(1, len(sizes)))
    ranges = partition_contiguous(sizes, parts)
    check_cover(ranges, len(sizes), parts)
    best = brute_force(sizes, parts)
    assert max(sum(sizes[i] for i in r) for r in ranges) == best
    assert min_max_part_sum(sizes, parts) == best


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 10**9), min_size=1, max_size=400), st.data())
def test_large_inputs_cover_in_order(sizes, data):
    parts = data.draw(st.integers(1, min(len(sizes), 64)))
    ranges = partition_contiguous(sizes, parts)
    check_cover(ranges, len(sizes), parts)
    assert max(sum(sizes[i] for i in r) for r in ranges) == min_max_part_sum(sizes, parts)


@pytest.mark.parametrize(
    "sizes,parts,match",
    [([1, 2], 0, "parts.*0"), ([1, 2], 3, "parts=3.*n=2"), ([1, -2], 1, r"sizes\[1\].*-2"),
     ([1, 2.5], 1, r"sizes\[1\].*2.5"), ([], 1, "parts=1.*n=0")],
)
def test_errors(sizes, parts, match):
    with pytest.raises(ValueError, match=match):
        partition_contiguous(sizes, parts)
