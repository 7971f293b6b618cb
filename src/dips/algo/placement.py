"""Where to put the parameter server (§10 of the seed).

B ∈ R^(N×M) holds the bandwidth from each of N candidate PS locations to each of M training
clusters, p ∈ R^M each cluster's training throughput; if clusters push in proportion to their
throughput, the PS should go to

    i* = argmax_i  B[i, ·] · p

which is not the location with the single fastest link but the one whose bandwidth is best
spent on the busiest clusters. Units are the caller's (e.g. Gbit/s and tokens/s); only the
ordering of the scores matters. Ties go to the lowest index.
"""

from __future__ import annotations

import math
from typing import Sequence


def _row(name: str, values: Sequence[float]) -> list[float]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise ValueError(f"{name} must be a sequence of numbers, got {values!r}")
    out = []
    for j, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}[{j}] must be a finite number >= 0, got {v!r}")
        out.append(float(v))
    return out


def placement_scores(bandwidth: Sequence[Sequence[float]], throughput: Sequence[float]) -> list[float]:
    """Score of every candidate: ``[B[i,·]·p for i in range(N)]`` (§10).

    Args:
        bandwidth: N rows of M bandwidths (finite, >= 0); N >= 1, M >= 1.
        throughput: M throughputs (finite, >= 0).

    Raises:
        ValueError: an empty matrix, a row whose length is not M, or a negative, NaN,
            infinite or non-numeric entry (naming its row and column).
    """
    p = _row("throughput", throughput)
    if not p:
        raise ValueError("throughput is empty: need one value per training cluster")
    if isinstance(bandwidth, (str, bytes)) or not hasattr(bandwidth, "__len__") or not len(bandwidth):
        raise ValueError("bandwidth has no rows: need one row per candidate location")
    scores = []
    for i, row in enumerate(bandwidth):
        b = _row(f"bandwidth[{i}]", row)
        if len(b) != len(p):
            raise ValueError(f"bandwidth row {i} has {len(b)} columns, throughput has {len(p)} "
                             f"clusters")
        scores.append(math.fsum(x * y for x, y in zip(b, p)))
    return scores


def best_placement(bandwidth: Sequence[Sequence[float]],
                   throughput: Sequence[float]) -> tuple[int, list[float]]:
    """``(i*, scores)`` with i* = argmax_i B[i,·]·p (lowest index on ties). Raises as
    :func:`placement_scores`."""
    scores = placement_scores(bandwidth, throughput)
    best = max(range(len(scores)), key=lambda i: (scores[i], -i))
    return best, scores
