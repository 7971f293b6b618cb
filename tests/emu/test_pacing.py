"""Injected per-step delays of real-time runs (dips.emu.pacing.Pacer, §13)."""

from __future__ import annotations

import math

import pytest

from dips.emu.pacing import Pacer

pytestmark = pytest.mark.timeout(30)


def test_calibrated_step_is_padded_to_step_s_times_slowdown():
    p = Pacer(slowdown=2.0, step_s=0.1)
    assert p.delay(0.03, t=5.0) == pytest.approx(0.17)
    assert p.overruns == 0


def test_transients_multiply_the_slowdown_only_while_active():
    p = Pacer(slowdown=1.5, step_s=0.1, transient=[(10.0, 20.0, 3.0), (15.0, 30.0, 2.0)])
    assert p.factor(9.99) == 1.5
    assert p.factor(12.0) == pytest.approx(4.5)
    assert p.factor(16.0) == pytest.approx(9.0)
    assert p.factor(25.0) == pytest.approx(3.0)
    assert p.factor(30.0) == 1.5
    assert p.delay(0.05, t=12.0) == pytest.approx(0.45 - 0.05)


def test_overrun_is_counted_not_shortened():
    p = Pacer(slowdown=1.0, step_s=0.1)
    assert p.delay(0.25, t=0.0) == 0.0
    assert p.overruns == 1


def test_measured_mode_is_proportional_to_the_measured_step():
    p = Pacer(slowdown=1.5, step_s=None, transient=[(0.0, 1.0, 2.0)])
    assert p.delay(0.2, t=0.5) == pytest.approx((3.0 - 1.0) * 0.2)
    assert p.delay(0.2, t=2.0) == pytest.approx(0.5 * 0.2)


@pytest.mark.parametrize("kwargs,match", [
    ({"slowdown": 0.5}, "slowdown"), ({"step_s": 0.0}, "step_s"), ({"step_s": math.inf}, "step_s"),
    ({"transient": [(5.0, 1.0, 2.0)]}, "transient"), ({"transient": [(0.0, 1.0, 0.5)]}, "transient"),
])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Pacer(**kwargs)
    with pytest.raises(ValueError, match="compute_s"):
        Pacer().delay(-1.0, t=0.0)
