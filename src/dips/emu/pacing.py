"""How long an emulated inner step waits after its real compute (§13 compute heterogeneity).

The seed's emulated clusters (§13) differ in speed by an injected delay of up to one
iteration.  Real-time runs inject that delay after each REAL inner step, in one of two ways:

* calibrated (``step_s`` given): the step is padded to ``step_s × slowdown(t)`` seconds of
  wall time, where ``slowdown(t)`` is the cluster's constant slowdown times any transient
  factor active at ``t``.  The real compute of a tiny model stands for a long step, so many
  clusters fit on a few cores and every cluster runs at the scenario's speed, not at the speed
  CPU contention gives it.  A step whose compute already exceeds its target is not shortened;
  it is counted as an overrun so reports can say when the pacing did not hold.
* measured (``step_s`` None): the delay is ``(slowdown(t) − 1) × compute_s``, i.e.
  :meth:`dips.emu.slowdown.Slowdown.delay` of the measured step (what ``dips launch`` does).

Pure arithmetic: the caller measures the compute time, passes the time since the start, and
sleeps.  Every real-time cluster process (Di-PS and the baselines) hands its :class:`Pacer` to
the one training loop, :func:`dips.train.run.run_loop`, so that every method is paced alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dips.emu.slowdown import Slowdown

__all__ = ["Pacer"]


class Pacer:
    """Per-step injected delay of one cluster (module docstring).

    Args:
        slowdown: constant slowdown factor s >= 1.
        step_s: calibrated seconds of one inner step at slowdown 1 (> 0), or None (measured).
        transient: ``(start_s, end_s, factor)`` extra slowdowns (seconds since the start,
            start < end, factor >= 1), multiplied with ``slowdown`` while active.

    Raises:
        ValueError: a slowdown < 1, a non-positive ``step_s`` or a malformed transient
            (named with its value).
    """

    def __init__(self, slowdown: float = 1.0, step_s: float | None = None,
                 transient: Sequence[tuple[float, float, float]] = ()) -> None:
        Slowdown(slowdown)  # validates
        if step_s is not None and (isinstance(step_s, bool) or not math.isfinite(step_s) or step_s <= 0):
            raise ValueError(f"step_s must be a finite number > 0 or None, got {step_s!r}")
        for tr in transient:
            if len(tr) != 3 or not (0 <= tr[0] < tr[1]) or not (math.isfinite(tr[2]) and tr[2] >= 1):
                raise ValueError(f"transient {tr!r} must be (start_s, end_s, factor) with "
                                 "0 <= start_s < end_s and factor >= 1")
        self.slowdown = float(slowdown)
        self.step_s = None if step_s is None else float(step_s)
        self.transient = [tuple(map(float, tr)) for tr in transient]
        self.overruns = 0

    def factor(self, t: float) -> float:
        """Slowdown at ``t`` seconds since the start: constant × active transient factors."""
        f = self.slowdown
        for start, end, factor in self.transient:
            if start <= t < end:
                f *= factor
        return f

    def delay(self, compute_s: float, t: float) -> float:
        """Seconds to wait after a step whose compute took ``compute_s`` s and ended at ``t``.

        Calibrated: ``max(0, step_s × factor(t) − compute_s)`` (an overrun is counted when
        negative); measured: ``(factor(t) − 1) × compute_s``.  Raises ValueError for a
        negative or non-finite ``compute_s``.
        """
        if not math.isfinite(compute_s) or compute_s < 0:
            raise ValueError(f"compute_s = {compute_s!r} must be a finite number >= 0")
        f = self.factor(t)
        if self.step_s is None:
            return Slowdown(f).delay(compute_s)
        d = self.step_s * f - compute_s
        if d < 0:
            self.overruns += 1
            return 0.0
        return d
