"""Dynamic grace time: the ski-rental window of §7 of the seed, estimated online.

After the first push request of an outer step opens the window, waiting τ seconds costs τ of
idle time for the waiting cluster; closing it while another request is about to arrive makes
that request miss the step and wait through the whole update and pull, a cost C_m. If
requests arrive as a Poisson process of rate λ, the chance that none arrives within τ is
exp(−λτ), so the expected cost is (§7)

    C(τ) = τ + C_m · exp(−λ τ),         minimised at  τ* = (1/λ) · ln(C_m · λ),

and τ* = 0 when C_m · λ <= 1 (waiting never pays). τ* is clamped to [0, max_s].

:class:`GraceEstimator` estimates λ from the arrival times of recent push requests (the
number of gaps over their time span) and C_m as an exponential moving average of the measured
update + pull time of recent outer steps. :class:`GraceWindow` is what the leader holds: in
``"fixed"`` mode it always returns the configured τ (the estimates are still kept, for the
log); in ``"dynamic"`` mode it returns τ*, or the fixed τ until both estimates exist.

Pure: time is passed in (float seconds on the caller's monotonic clock); nothing here reads a
clock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

MODES = ("fixed", "dynamic")


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


@dataclass
class GraceEstimator:
    """Online estimates of λ and C_m (§7).

    Attributes:
        arrivals: how many recent request times λ is estimated from (>= 2).
        alpha: weight of the newest update+pull time in the C_m average, in (0, 1].
    """

    arrivals: int = 16
    alpha: float = 0.3
    _times: deque = field(default_factory=deque, repr=False)
    _miss_cost: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.arrivals, bool) or not isinstance(self.arrivals, int) or self.arrivals < 2:
            raise ValueError(f"arrivals must be an int >= 2, got {self.arrivals!r}")
        if not 0.0 < _number("alpha", self.alpha) <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha!r}")
        self._times = deque(maxlen=self.arrivals)

    def observe_request(self, t: float) -> None:
        """Record a push request that arrived at time ``t`` (seconds; finite, not earlier
        than the previous one). Raises ValueError otherwise."""
        t = _number("t", t, -math.inf)
        if math.isinf(t) or (self._times and t < self._times[-1]):
            raise ValueError(f"t must be finite and >= the previous arrival, got {t!r}")
        self._times.append(t)

    def observe_round(self, update_s: float, pull_s: float) -> None:
        """Record one outer step's update and pull durations (seconds, finite, >= 0)."""
        cost = _number("update_s", update_s) + _number("pull_s", pull_s)
        if math.isinf(cost):
            raise ValueError(f"update_s and pull_s must be finite, got {update_s!r}, {pull_s!r}")
        self._miss_cost = cost if self._miss_cost is None else (
            self.alpha * cost + (1.0 - self.alpha) * self._miss_cost)

    @property
    def rate_per_s(self) -> float | None:
        """λ = (n − 1) / (t_n − t_1) over the kept arrivals; None before 2 distinct times."""
        if len(self._times) < 2 or self._times[-1] <= self._times[0]:
            return None
        return (len(self._times) - 1) / (self._times[-1] - self._times[0])

    @property
    def miss_cost_s(self) -> float | None:
        """C_m, the moving average of update + pull seconds; None before the first round."""
        return self._miss_cost


class GraceWindow:
    """The leader's grace window, fixed or dynamic (§6, §7).

    Args:
        mode: "fixed" (always ``fixed_s``) or "dynamic" (τ* of the estimates).
        fixed_s: the fixed window in seconds (>= 0); also the dynamic window's value until
            λ and C_m are both known.
        max_s: clamp of the dynamic window in seconds (>= 0).
        estimator: the λ / C_m estimator (default :class:`GraceEstimator`).

    Raises:
        ValueError: unknown mode or a negative / NaN duration (naming it).
    """

    def __init__(self, mode: str = "fixed", fixed_s: float = 1.0, max_s: float = 30.0,
                 estimator: GraceEstimator | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"grace mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.fixed_s = _number("fixed_s", fixed_s)
        self.max_s = _number("max_s", max_s)
        if math.isinf(self.fixed_s):
            raise ValueError(f"fixed_s must be finite, got {fixed_s!r}")
        self.estimator = estimator or GraceEstimator()

    def observe_request(self, t: float) -> None:
        self.estimator.observe_request(t)

    def observe_round(self, update_s: float, pull_s: float) -> None:
        self.estimator.observe_round(update_s, pull_s)

    def dynamic_s(self) -> float | None:
        """τ* from the current estimates (clamped), or None while one is unknown."""
        lam, cm = self.estimator.rate_per_s, self.estimator.miss_cost_s
        if lam is None or cm is None:
            return None
        return optimal_grace_s(lam, cm, self.max_s)

    def seconds(self) -> float:
        """The window to use now, in seconds."""
        if self.mode == "fixed":
            return self.fixed_s
        tau = self.dynamic_s()
        return min(self.fixed_s, self.max_s) if tau is None else tau

    def close_time(self, opened_at: float) -> float:
        """When a window opened at ``opened_at`` (finite seconds) closes."""
        t = _number("opened_at", opened_at, -math.inf)
        if math.isinf(t):
            raise ValueError(f"opened_at must be a finite number of seconds, got {opened_at!r}")
        return t + self.seconds()

    def state(self) -> dict[str, float | None]:
        """What the leader checkpoints: the C_m estimate (seconds). λ is not kept: the arrival
        times belong to the old process's clock, and new arrivals re-estimate it."""
        return {"miss_cost_s": self.estimator.miss_cost_s}

    def restore(self, state: dict[str, float | None]) -> None:
        """Resume the C_m estimate saved by :meth:`state`. Raises ValueError if malformed."""
        cm = state.get("miss_cost_s")
        if cm is not None:
            self.estimator.observe_round(_number("miss_cost_s", cm), 0.0)

    def stats(self) -> dict[str, float | str | None]:
        """Mode, window now, λ, C_m and τ* (None where unknown), for the outer-step log."""
        tau = self.dynamic_s()
        lam, cm = self.estimator.rate_per_s, self.estimator.miss_cost_s
        return {"mode": self.mode, "window_s": round(self.seconds(), 4),
                "rate_per_s": None if lam is None else round(lam, 4),
                "miss_cost_s": None if cm is None else round(cm, 4),
                "tau_star_s": None if tau is None else round(tau, 4)}
