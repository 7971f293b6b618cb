"""Emulated compute heterogeneity (§13 of the seed).

A cluster with slowdown factor s >= 1 waits (s − 1) × the measured duration of each inner
step after the step, so its wall time per step is s times that of an unslowed cluster on the
same hardware, while the training itself stays real.  The slowdowns of a generated scenario
(η spread over [1, 1 + η/100]) come from :func:`dips.spec.scenario.spread`.
"""

from __future__ import annotations

import math

__all__ = ["Slowdown"]


class Slowdown:
    """Per-inner-step injected delay.

    Args:
        factor: slowdown s >= 1 (1.0: none).

    Raises:
        ValueError: factor < 1 or not finite.
    """

    def __init__(self, factor: float) -> None:
        if not math.isfinite(factor) or factor < 1.0:
            raise ValueError(f"slowdown factor = {factor} must be a finite number >= 1")
        self.factor = factor

    def delay(self, step_s: float) -> float:
        """Seconds to wait after an inner step that took ``step_s`` seconds (>= 0)."""
        if step_s < 0 or not math.isfinite(step_s):
            raise ValueError(f"step_s = {step_s} must be a finite number >= 0")
        return (self.factor - 1.0) * step_s
