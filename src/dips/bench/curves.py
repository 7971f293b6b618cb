"""What every loss plot of dips agrees on: when a run diverged, the y-range that follows the
runs that converge, and each method's line style (issue 15: a diverged ablation with a loss
of 11,719 used to set the axis and flatten every other curve to a line at 0).

Pure functions of loss values (nats/token); :mod:`dips.bench.plots` (``dips bench compare``)
and :mod:`dips.bench.runreport` (``dips report``) both draw with them.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

__all__ = ["diverged", "loss_range", "method_style"]


def diverged(losses: Sequence[float]) -> bool:
    """Whether a run's loss curve diverged: some loss is not finite (NaN, ±inf), or its last
    loss is above its first (it ended worse than the initial model). An empty curve or a
    single finite point has not."""
    if not all(math.isfinite(v) for v in losses):
        return True
    return len(losses) > 1 and losses[-1] > losses[0]


def loss_range(curves: Iterable[Sequence[float]], margin: float = 0.05) -> tuple[float, float] | None:
    """The y-range (nats/token) of a loss plot: every loss of the curves that did not diverge,
    with ``margin`` × its span on each side (0.5 when they are all equal); None when every
    curve diverged or none has a point (matplotlib then scales to the finite values)."""
    ys = [v for c in curves if not diverged(c) for v in c]
    if not ys:
        return None
    lo, hi = min(ys), max(ys)
    pad = margin * (hi - lo) if hi > lo else 0.5
    return lo - pad, hi + pad


def method_style(method: str) -> dict[str, Any]:
    """matplotlib line keywords of a method: Di-PS bold red, its ablations dotted, baselines plain."""
    if method == "di-ps":
        return {"linewidth": 2.2, "color": "C3"}
    if method.startswith("di-ps"):
        return {"linewidth": 1.0, "linestyle": ":"}
    return {"linewidth": 1.4}
