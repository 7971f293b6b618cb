"""Layer ownership: split the model's tensors into contiguous follower shards (§10 of the seed).

Each follower owns a contiguous run of layers (tensors in model order) and holds them in FP32
with their Nesterov momentum. The outer step finishes when the slowest follower finishes, and
a follower's work and memory grow with its bytes, so the split minimizes the largest shard.

The optimum is exact: the minimal feasible bound X is found by binary search over integers
(feasibility of "at most `parts` runs, each <= X" is monotone in X and checked greedily), then
one partition into exactly `parts` non-empty runs with every sum <= X is built. This is the
same optimum as the textbook O(parts · n²) dynamic program, in O(n · log Σ sizes).
"""

from __future__ import annotations


def _runs_needed(sizes: list[int], bound: int) -> int:
    """Fewest contiguous runs with every sum <= bound (requires bound >= max(sizes))."""
    runs, current = 1, 0
    for s in sizes:
        if current + s > bound:
            runs += 1
            current = 0
        current += s
    return runs


def min_max_part_sum(sizes: list[int], parts: int) -> int:
    """Return the smallest possible maximum part sum over splits into `parts` contiguous runs.

    Args, errors and source as :func:`partition_contiguous` (§10 of the seed).
    """
    _validate(sizes, parts)
    lo, hi = max(sizes), sum(sizes)
    # Invariant: hi is feasible; every bound < lo is infeasible.
    while lo < hi:
        mid = (lo + hi) // 2
        if _runs_needed(sizes, mid) <= parts:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _validate(sizes: list[int], parts: int) -> None:
    if not isinstance(sizes, (list, tuple)):
        raise ValueError(f"sizes must be a list of ints, got {type(sizes).__name__}")
    for i, s in enumerate(sizes):
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"sizes[{i}] must be an int >= 0, got {s!r}")
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be an int >= 1, got {parts!r}")
    if parts > len(sizes):
        raise ValueError(f"parts={parts} exceeds the number of sizes n={len(sizes)}")


def partition_contiguous(sizes: list[int], parts: int) -> list[range]:
    """Split indices 0..n-1 into `parts` contiguous non-empty ranges minimizing the largest sum.

    Args:
        sizes: per-tensor (or per-layer) sizes in bytes, ints >= 0, in model order; n = len.
        parts: number of followers, 1 <= parts <= n.

    Returns:
        ``parts`` ranges, in order, covering 0..n-1 exactly once, each non-empty, with
        max_i Σ_{k in range_i} sizes[k] minimal. Among optimal splits, earlier ranges are made
        as long as possible (deterministic).

    Raises:
        ValueError: parts < 1, parts > n, or a size that is not an int >= 0 (naming the index
            and value). Source: §10 of the seed (layer ownership by followers).
    """
    bound = min_max_part_sum(sizes, parts)
    n = len(sizes)
    ranges: list[range] = []
    start = 0
    for p in range(parts):
        left_after = parts - p - 1  # runs still to form after this one
        if left_after == 0:
            ranges.append(range(start, n))
            break
        end, current = start + 1, sizes[start]
        # Extend while the bound allows and enough indices stay for the remaining runs; once
        # that reserve binds, every later run is a single index (<= max(sizes) <= bound).
        while end < n - left_after and current + sizes[end] <= bound:
            current += sizes[end]
            end += 1
        ranges.append(range(start, end))
        start = end
    return ranges
