"""The robust bound on what enters the §8 statistics (issue 13, review 30: a ratcheting member).

``decide(..., bound=B)``: a G above B enters μ, σ and the recent-score stack as B (its score as
B's), while the verdict still tests the G as pushed; :func:`dips.algo.aggregate.push_bound` is
the bound the leader passes, ``push_norm_ratio``² × μ_robust. Hand-computed on the §11 state
(μ = 4.5, σ = 1, recent scores 0.3, 2.0, −1.0: threshold 6)."""

from __future__ import annotations

import math

import pytest

from dips.algo.aggregate import push_bound, robust_scale
from dips.algo.penalty import PenaltyConfig, PenaltyState, decide

CFG = PenaltyConfig()


def scored_state() -> PenaltyState:
    return PenaltyState.from_moments(4.5, 1.0, 1000, [0.3, 2.0, -1.0])


def test_an_accepted_push_above_the_bound_enters_the_statistics_as_the_bound():
    verdict, new = decide(scored_state(), {"A": 4.0, "H": 9.0}, CFG, bound=6.0)
    # The test is §8's on the G pushed: E_H = (9 − 4.5) / 1 = 4.5 <= 6, accepted.
    assert verdict.accepted == ["A", "H"] and verdict.scores == {"A": -0.5, "H": 4.5}
    # μ, σ move as if H had pushed 6: μ = 0.02·6 + 0.98·(0.02·4 + 0.98·4.5) = 4.5202.
    _, at_bound = decide(scored_state(), {"A": 4.0, "H": 6.0}, CFG)
    assert new.sources == at_bound.sources
    assert new.mu == pytest.approx(4.5202, rel=1e-12)
    # The stack holds 6's score, (6 − 4.5) / 1 = 1.5, not 4.5: the next threshold is
    # β · max(2.0, 1.5) = 6, where §8 as written gives 3 · 4.5 = 13.5.
    assert [s for _, s in new.recent] == [0.3, 2.0, -1.0, -0.5, 1.5]
    assert decide(new, {"A": 4.0}, CFG, bound=6.0)[0].thresholds == {"A": 6.0}
    assert decide(decide(scored_state(), {"A": 4.0, "H": 9.0}, CFG)[1], {"A": 4.0},
                  CFG)[0].thresholds == {"A": 13.5}


def test_a_rejected_push_enters_at_the_smaller_of_the_bound_and_the_acceptance_bound():
    # 81 is rejected (76.5 > 6); it counts as min(4.5 + 6 · 1, 5) = 5, and not in the stack.
    verdict, new = decide(scored_state(), {"A": 4.0, "H": 81.0}, CFG, bound=5.0)
    assert verdict.rejected == ["H"]
    assert new.sources == decide(scored_state(), {"A": 4.0, "H": 5.0}, CFG)[1].sources
    assert [s for _, s in new.recent] == [0.3, 2.0, -1.0, -0.5]
    # A bound above the acceptance bound (10.5) changes nothing.
    wide = decide(scored_state(), {"A": 4.0, "H": 81.0}, CFG, bound=20.0)[1]
    assert wide == decide(scored_state(), {"A": 4.0, "H": 81.0}, CFG)[1]


@pytest.mark.parametrize("enabled", [True, False])
def test_below_the_bound_nothing_changes_bit_for_bit(enabled):
    cfg = PenaltyConfig(enabled=enabled)
    norms = {"A": 4.0, "B": 5.0, "C": 81.0}
    assert decide(scored_state(), norms, cfg, bound=81.0) == decide(scored_state(), norms, cfg)
    warm = decide(PenaltyState(), {"a": 1.0, "b": 3.0}, cfg, bound=3.0)
    assert warm == decide(PenaltyState(), {"a": 1.0, "b": 3.0}, cfg)


def test_the_warm_up_takes_the_bounded_values():
    # 1 and min(100, 4) = 4: the exact mean 2.5 and population std 1.5.
    verdict, new = decide(PenaltyState(), {"a": 1.0, "b": 100.0}, CFG, bound=4.0)
    assert verdict.accepted == ["a", "b"] and verdict.scores == {"a": None, "b": None}
    mu, sigma = new.pooled(CFG)
    assert mu == pytest.approx(2.5, rel=1e-12) and sigma == pytest.approx(1.5, rel=1e-12)


def test_a_member_growing_its_push_cannot_ratchet_the_threshold_past_the_bounds_score():
    """Review 30's member multiplies its pseudo-gradient by 1.6 after each accepted push (G ×
    2.56); §8 alone lets each accepted score lift the next threshold up to β times. Under a
    bound B every stack entry is at most (B − μ_t) / σ_t, so the threshold stays at most
    β · max(floor, those) and the member is refused within a few pushes."""
    for bound, most in ((None, 10), (6.0, 2)):
        # σ = 3: H's first push, 8, scores 1.17 (the threshold is 6), as an honest one might.
        state = PenaltyState.from_moments(4.5, 3.0, 1000, [0.3, 2.0, -1.0])
        g, accepted, thresholds = 8.0, 0, []
        for _ in range(10):
            verdict, state = decide(state, {"A": 4.0, "B": 5.0, "H": g}, CFG, bound=bound)
            thresholds.append(verdict.thresholds["H"])
            if "H" not in verdict.accepted:
                break
            accepted, g = accepted + 1, g * 2.56
        assert accepted == most
        if bound is None:  # §8 as written: accepted at G = 8 · 2.56^9 = 3.8e4, μ ≈ 8e3
            assert max(thresholds) > 50.0 and state.mu > 1e3
        else:
            assert max(thresholds) == 6.0 and state.mu < 4.6


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, "6", True])
def test_a_bad_bound_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="bound"):
        decide(scored_state(), {"A": 4.0}, CFG, bound=bad)


def test_push_bound_is_the_ratio_squared_times_the_robust_scale():
    assert push_bound(1.5, 2.0) == 6.0
    assert push_bound(None, 2.0) is None and push_bound(1.5, None) is None
    assert push_bound(0.0, 3.0) == 0.0
    # The same bound scales the pushes: 6 passes whole, 24 is halved in norm.
    assert robust_scale({"a": 6.0, "h": 24.0}, 3.0, 1.5, 2.0)[0] == {"a": 1.0, "h": 0.5}


@pytest.mark.parametrize("mu_robust,ratio,field", [(1.0, 1.0, "push_norm_ratio"),
                                                   (1.0, math.nan, "push_norm_ratio"),
                                                   (1.0, True, "push_norm_ratio"),
                                                   (-1.0, 2.0, "mu_robust"),
                                                   (math.inf, 2.0, "mu_robust")])
def test_push_bound_refuses_bad_input_naming_the_field(mu_robust, ratio, field):
    with pytest.raises(ValueError, match=field):
        push_bound(mu_robust, ratio)
