"""The penalty's history as EMA masses per cluster, and the robust scale they give (§8 of the
seed; issue 13).

:class:`Moments` holds one source's masses of (1, G, G²); :func:`_absorb` adds a step's G
values with their EMA rates (West, 1979); :func:`robust_mu` is the scale of ‖Δ_j‖² that fewer
than half of the members cannot lift, from each cluster's own mean. Used by
:mod:`dips.algo.penalty` (which re-exports these names) and, through it, by the leader's
aggregation (:mod:`dips.algo.aggregate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from dips.spec import PenaltyConfig

if TYPE_CHECKING:
    from dips.algo.penalty import PenaltyState

__all__ = ["PRUNE_MASS", "SHARED", "SIGMA_EPS", "Moments", "robust_mu"]

#: Absolute floor of sigma: keeps E finite when all observed G are 0.
SIGMA_EPS = 1e-12
#: A cluster whose share fell below this is folded into the unattributed history ("").
PRUNE_MASS = 1e-9
#: Key of the history no current cluster owns (a pre-issue-13 checkpoint, pruned clusters).
SHARED = ""


@dataclass(frozen=True)
class Moments:
    """EMA masses of one source of history: ``w`` = Σ weights, ``a`` = Σ w·G, ``b`` = Σ w·G².

    Units: ``a`` in Δ², ``b`` in Δ⁴. The mean is a / w and the variance b / w − (a / w)².
    """

    w: float = 0.0
    a: float = 0.0
    b: float = 0.0

    def __add__(self, other: "Moments") -> "Moments":
        return Moments(self.w + other.w, self.a + other.a, self.b + other.b)

    def __sub__(self, other: "Moments") -> "Moments":
        return Moments(self.w - other.w, self.a - other.a, self.b - other.b)

    def scaled(self, k: float) -> "Moments":
        return Moments(self.w * k, self.a * k, self.b * k)

    def stats(self, cfg: PenaltyConfig) -> tuple[float, float]:
        """(μ, σ) of this mass, σ floored at max(sigma_floor_rel · μ, SIGMA_EPS)
        (:mod:`dips.algo.penalty`); requires w > 0."""
        mu = self.a / self.w
        var = max(0.0, self.b / self.w - mu * mu)
        return mu, max(math.sqrt(var), cfg.sigma_floor_rel * mu, SIGMA_EPS)


def _absorb(sources: Mapping[str, Moments], items: list[tuple[str, float]],
            rates: list[float]) -> dict[str, Moments]:
    """The moments after adding each ``(cluster, G)`` in order with its EMA rate: every earlier
    mass decays by (1 − rate) and the new G gets weight rate. Shares below PRUNE_MASS are folded
    into the unattributed history."""
    # On (w, a, b) tuples: the same float operations, in the same order, as Moments.scaled
    # and Moments.__add__ (bit for bit), without an object per source and item (a round of
    # 100 pushes over 1,024 sources made 100,000 of them).
    out = {c: (m.w, m.a, m.b) for c, m in sources.items()}
    for (cid, g), r in zip(items, rates):
        k = 1.0 - r
        out = {c: (w * k, a * k, b * k) for c, (w, a, b) in out.items()}
        w, a, b = out.get(cid, (0.0, 0.0, 0.0))
        out[cid] = (w + r, a + r * g, b + r * g * g)
    pruned = {c: Moments(*m) for c, m in out.items() if c == SHARED or m[0] >= PRUNE_MASS}
    folded = [Moments(*m) for c, m in out.items() if c not in pruned]
    if folded:
        pruned[SHARED] = sum(folded, pruned.get(SHARED, Moments()))
    return pruned


def robust_mu(state: PenaltyState, members: int = 0,
              prior: float | None = None) -> float | None:
    """A scale of ‖Δ_j‖² (units of Δ²) that a minority of members cannot lift, from each
    cluster's own EMA mean μ_j = a_j / w_j in the history (issue 13).

    With n = max(``members``, clusters in the history) the run's members and k ≤ n of them
    with a history, at most F = ⌈n/2⌉ − 1 of them hostile (fewer than half): while k is below
    the quorum q = max(⌈n/2⌉, min(2, n)) the hostile ones may be all that pushed so far, and
    nothing a member pushed can be believed, so the result is ``prior`` (the caller's absolute
    scale: the seed's clip norm c squared, §8). From k ≥ q on it is the μ_j of rank k − q
    (ascending, from 0): the highest rank that the F largest means cannot reach, so that
    hostile members can never lift it, and as far as that allows from the smallest, so that
    near-zero pushes of a few cannot shrink it (with every member in the history: the median,
    the upper one for even n). Reviews of 2026-12-01: one member that pushed first and alone
    set the scale (steps of 4e9; in a run of two, 5e9). Two-sided safety needs k ≥ 2F + 1:
    with a member down, F members pushing near zero can shrink the scale (a stall).

    Args:
        state: the §8 history (:func:`dips.algo.penalty.decide`'s output).
        members: clusters of the run (the leader: its configured clusters or the members now
            joined, whichever is more); 0: those in the history.
        prior: the scale before enough members pushed (None: no bound).

    Returns None before the first G; the pooled μ when no cluster owns any history (a
    pre-issue-13 checkpoint, the §11 example).
    """
    means = sorted(m.a / m.w for cid, m in state.sources.items() if cid != SHARED and m.w > 0)
    if not means:
        return state.mu
    k = len(means)
    n = max(members, k)
    quorum = max((n + 1) // 2, min(2, n))
    if k < quorum:
        return prior
    return means[k - quorum]
