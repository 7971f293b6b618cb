"""Grace window of the outer step: fixed τ, or the ski-rental τ* of §7, estimated online.

The first push request of an outer step opens the window; requests arriving before it closes
join the same outer step, later ones wait for the next (§6). Closing at once makes a cluster
that finishes seconds later miss the step and wait through a whole update and pull; waiting
long idles the fastest cluster (§7). If requests arrive as a Poisson process of rate λ and a
request that misses the window waits C_m seconds more, the expected cost of a window τ is

    C(τ) = τ + C_m · exp(−λ τ),         minimised at  τ* = (1/λ) · ln(C_m · λ),

and τ* = 0 when C_m · λ <= 1 (waiting never pays); τ* is clamped to [0, max_s].

:class:`GraceState` is the estimator's state, updated by pure functions: λ from the arrival
times of the last :data:`ARRIVALS` push requests (gaps over their time span), C_m as an
exponential moving average (weight :data:`ALPHA`) of the measured update + pull time of recent
outer steps. :func:`window_s` is what the leader's round uses: in ``fixed`` mode always the
configured τ (the estimates are still kept, for the log); in ``dynamic`` mode τ*, or the fixed
τ (clamped to ``max_s``) until both estimates exist. The grace settings are a
:class:`dips.spec.GraceConfig` (any object with ``mode``, ``window_s`` and ``max_s``).

Pure: time is passed in (float seconds on the caller's monotonic or virtual clock); nothing
here reads a clock, so the real leader and the virtual-time engine share every rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

MODES = ("fixed", "dynamic")
#: Push requests λ is estimated from (the most recent ones).
ARRIVALS = 16
#: Weight of the newest update + pull time in the C_m moving average.
ALPHA = 0.3


def _number(name: str, x: object, minimum: float = 0.0) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x) or x < minimum:
        raise ValueError(f"{name} must be a number >= {minimum}, got {x!r}")
    return float(x)


def expected_cost_s(tau_s: float, rate_per_s: float, miss_cost_s: float) -> float:
    """C(τ) = τ + C_m·exp(−λτ) in seconds (§7). Raises ValueError on a negative input."""
    tau = _number("tau_s", tau_s)
    return tau + _number("miss_cost_s", miss_cost_s) * math.exp(-_number("rate_per_s", rate_per_s) * tau)


def optimal_grace_s(rate_per_s: float, miss_cost_s: float, max_s: float = math.inf) -> float:
    """τ* = (1/λ)·ln(C_m·λ), 0 when C_m·λ <= 1, clamped to [0, max_s] (§7).

    Args:
        rate_per_s: λ, push requests per second (>= 0; 0 gives 0).
        miss_cost_s: C_m, seconds a request that misses the window waits (>= 0).
        max_s: upper clamp in seconds (>= 0, may be inf).

    Raises:
        ValueError: a negative or NaN argument, or an infinite λ or C_m (naming it).
    """
    lam = _number("rate_per_s", rate_per_s)
    cm = _number("miss_cost_s", miss_cost_s)
    cap = _number("max_s", max_s)
    if math.isinf(lam) or math.isinf(cm):
        raise ValueError(f"rate_per_s and miss_cost_s must be finite, got {lam!r}, {cm!r}")
    if lam == 0.0 or cm * lam <= 1.0:
        return 0.0
    return min(cap, math.log(cm * lam) / lam)


@dataclass(frozen=True)
class GraceState:
    """The §7 estimates: recent request times (seconds, ascending, at most :data:`ARRIVALS`)
    and C_m (seconds; None before the first outer step)."""

    arrivals: tuple[float, ...] = ()
    miss_cost_s: float | None = None

    @property
    def rate_per_s(self) -> float | None:
        """λ = (n − 1) / (t_n − t_1) over the kept arrivals; None before 2 distinct times."""
        a = self.arrivals
        if len(a) < 2 or a[-1] <= a[0]:
            return None
        return (len(a) - 1) / (a[-1] - a[0])


def observe_request(state: GraceState, t: float, keep: int = ARRIVALS) -> GraceState:
    """``state`` with a push request that arrived at ``t`` seconds (finite, not earlier than
    the previous one; the newest ``keep`` >= 2 are kept). Raises ValueError otherwise."""
    t = _number("t", t, -math.inf)
    if math.isinf(t) or (state.arrivals and t < state.arrivals[-1]):
        raise ValueError(f"t must be finite and >= the previous arrival, got {t!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 2:
        raise ValueError(f"keep must be an int >= 2, got {keep!r}")
    return replace(state, arrivals=(*state.arrivals, t)[-keep:])


def observe_round(state: GraceState, update_s: float, pull_s: float,
                  alpha: float = ALPHA) -> GraceState:
    """``state`` with one outer step's update and pull durations (seconds, finite, >= 0)
    folded into C_m (the first one sets it). Raises ValueError on a bad duration or alpha."""
    cost = _number("update_s", update_s) + _number("pull_s", pull_s)
    if math.isinf(cost):
        raise ValueError(f"update_s and pull_s must be finite, got {update_s!r}, {pull_s!r}")
    if not 0.0 < _number("alpha", alpha) <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
    old = state.miss_cost_s
    return replace(state, miss_cost_s=cost if old is None else alpha * cost + (1.0 - alpha) * old)


def _check(grace: Any) -> None:
    if grace.mode not in MODES:
        raise ValueError(f"grace field 'mode' = {grace.mode!r} must be one of {MODES}")


def dynamic_s(state: GraceState, grace: Any) -> float | None:
    """τ* from the estimates, clamped to ``grace.max_s``; None while λ or C_m is unknown."""
    lam, cm = state.rate_per_s, state.miss_cost_s
    if lam is None or cm is None:
        return None
    return optimal_grace_s(lam, cm, grace.max_s)


def window_s(state: GraceState, grace: Any) -> float:
    """The window to open now, in seconds (see the module docstring).

    Raises ValueError on an unknown ``grace.mode``.
    """
    _check(grace)
    if grace.mode == "fixed":
        return float(grace.window_s)
    tau = dynamic_s(state, grace)
    return float(min(grace.window_s, grace.max_s)) if tau is None else tau


def stats(state: GraceState, grace: Any) -> dict[str, float | str | None]:
    """Mode, window now, λ, C_m and τ* (None where unknown), for the outer-step log."""
    tau = dynamic_s(state, grace)
    lam, cm = state.rate_per_s, state.miss_cost_s
    return {"mode": grace.mode, "window_s": round(window_s(state, grace), 4),
            "rate_per_s": None if lam is None else round(lam, 4),
            "miss_cost_s": None if cm is None else round(cm, 4),
            "tau_star_s": None if tau is None else round(tau, 4)}


def to_dict(state: GraceState) -> dict[str, float | None]:
    """What the leader checkpoints: C_m (seconds). λ is not kept: the arrival times belong to
    the old process's clock, and new arrivals re-estimate it."""
    return {"miss_cost_s": state.miss_cost_s}


def from_dict(data: dict[str, Any]) -> GraceState:
    """Resume the estimates saved by :func:`to_dict`. Raises ValueError if malformed."""
    cm = data.get("miss_cost_s")
    return GraceState(miss_cost_s=None if cm is None else _number("miss_cost_s", cm))
