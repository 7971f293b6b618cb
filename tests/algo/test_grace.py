"""Dynamic grace time (§7): the ski-rental formula and its online estimates, by hand."""

from __future__ import annotations

import math

import pytest

from dips.algo import grace as g
from dips.algo.grace import GraceState, expected_cost_s, optimal_grace_s
from dips.spec.protocol import GraceConfig


def test_formula_by_hand():
    # λ = 2/s, C_m = 5 s: C_m·λ = 10, τ* = ln(10)/2 = 1.151292546...
    assert optimal_grace_s(2.0, 5.0) == pytest.approx(1.1512925465, abs=1e-9)
    # τ* is the minimum of C(τ) = τ + 5·exp(−2τ): C(τ*) = ln(10)/2 + 0.5.
    tau = optimal_grace_s(2.0, 5.0)
    assert expected_cost_s(tau, 2.0, 5.0) == pytest.approx(1.1512925465 + 0.5, abs=1e-9)
    for d in (-0.2, -0.01, 0.01, 0.2):
        assert expected_cost_s(tau + d, 2.0, 5.0) > expected_cost_s(tau, 2.0, 5.0)


@pytest.mark.parametrize("lam,cm", [(0.5, 1.0), (1.0, 1.0), (0.0, 100.0), (3.0, 0.0)])
def test_no_wait_when_waiting_never_pays(lam, cm):
    assert optimal_grace_s(lam, cm) == 0.0


def test_clamped_to_max():
    # λ = 0.1, C_m = 1000 s: ln(100)/0.1 = 46.05 s -> clamped.
    assert optimal_grace_s(0.1, 1000.0) == pytest.approx(46.0517, abs=1e-4)
    assert optimal_grace_s(0.1, 1000.0, max_s=30.0) == 30.0
    assert optimal_grace_s(0.1, 1000.0, max_s=0.0) == 0.0


@pytest.mark.parametrize("args,match", [((-1.0, 1.0), "rate_per_s"), ((1.0, math.nan), "miss_cost_s"),
                                        ((math.inf, 1.0), "finite"), ((1.0, 1.0, -2.0), "max_s"),
                                        (("1", 1.0), "rate_per_s")])
def test_formula_refuses_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        optimal_grace_s(*args)


def test_estimates_by_hand():
    s = GraceState()
    assert s.rate_per_s is None and s.miss_cost_s is None
    for t in (100.0, 101.0, 103.0, 104.0):
        s = g.observe_request(s, t, keep=4)
    assert s.rate_per_s == pytest.approx(3 / 4)  # 3 gaps over 4 s
    s = g.observe_request(s, 108.0, keep=4)  # window of 4: 101, 103, 104, 108 -> 3 gaps over 7 s
    assert s.rate_per_s == pytest.approx(3 / 7)
    s = g.observe_round(s, 2.0, 1.0)
    assert s.miss_cost_s == pytest.approx(3.0)
    s = g.observe_round(s, 4.0, 2.0, alpha=0.3)  # EMA: 0.3·6 + 0.7·3 = 3.9
    assert s.miss_cost_s == pytest.approx(3.9)


def test_bad_observations_are_refused():
    s = g.observe_request(GraceState(), 5.0)
    with pytest.raises(ValueError, match="previous arrival"):
        g.observe_request(s, 4.0)
    with pytest.raises(ValueError, match="update_s"):
        g.observe_round(s, -1.0, 0.0)
    with pytest.raises(ValueError, match="keep"):
        g.observe_request(s, 6.0, keep=1)
    with pytest.raises(ValueError, match="alpha"):
        g.observe_round(s, 1.0, 0.0, alpha=0.0)
    assert s.rate_per_s is None and s.miss_cost_s is None  # nothing recorded


def test_window_modes():
    fixed = GraceConfig(mode="fixed", window_s=8.0, max_s=30.0)
    dyn = GraceConfig(mode="dynamic", window_s=8.0, max_s=5.0)
    s = GraceState()
    # Until λ and C_m are known the dynamic window uses the fixed value, clamped to max_s.
    assert g.window_s(s, fixed) == 8.0 and g.window_s(s, dyn) == 5.0
    for t in (0.0, 0.25, 0.5, 0.75, 1.0):  # λ = 4 gaps / 1 s = 4/s
        s = g.observe_request(s, t)
    s = g.observe_round(s, 0.5, 0.5)  # C_m = 1 s: C_m·λ = 4, τ* = ln(4)/4 = 0.34657 s
    assert g.window_s(s, fixed) == 8.0
    assert g.window_s(s, dyn) == pytest.approx(math.log(4) / 4)
    assert g.stats(s, dyn) == {"mode": "dynamic", "window_s": 0.3466, "rate_per_s": 4.0,
                               "miss_cost_s": 1.0, "tau_star_s": 0.3466}
    assert g.stats(s, fixed)["tau_star_s"] == 0.3466  # estimated but not used


def test_state_round_trip_keeps_the_miss_cost():
    s = g.observe_round(GraceState(), 0.4, 0.2)
    again = g.from_dict(g.to_dict(s))
    assert again.miss_cost_s == pytest.approx(0.6) and again.arrivals == ()
    assert g.to_dict(GraceState()) == {"miss_cost_s": None}
    with pytest.raises(ValueError, match="miss_cost_s"):
        g.from_dict({"miss_cost_s": -1.0})
