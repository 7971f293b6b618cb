"""A ratcheting member (review 30, ``/tmp/review30``; RELIABILITY.md, "A ratcheting member lifts
the penalty's statistics"): one member of three multiplies its pseudo-gradient by k before each
push, k × 1.6 after each accepted one. In the real run 11 pushes were accepted in a row (‖Δ‖²
31,364 against ≈ 1 honest, the threshold 3 → 64), and after it left the honest-only steps were
2.1–2.25× for about 160 rounds: §8's pooled μ, lifted to 570, kept the relative clip's μ at its
cap of 4 μ_robust until it decayed at α. Now no G enters μ, σ or the recent-score stack above
``push_norm_ratio``² × μ_robust (:func:`dips.algo.aggregate.push_bound`), so the threshold
cannot follow the member and its pushes leave the statistics as an honest-looking one would.

The rounds run through :func:`dips.roles.outer_step.run_update` (the real leader's and the
virtual-time engine's code). Each cluster's Δ_j = a_j·u + b_j·v_j (u shared, v_j its own
orthogonal direction, a_j² = 0.8·G_j, b_j² = 0.2·G_j), so the mean δ of honest pushes is near
their norm and the relative clip binds on every round, as in the real run: a step is
clip_ratio × √(the clip's μ). Honest G_j are log-normal with mean 1 (σ ≈ 0.5), a fixed draw."""

from __future__ import annotations

import math
import random

import pytest

from dips.algo.penalty import Moments, PenaltyState, decide, robust_mu
from dips.algo.round import Slot
from dips.roles.outer_step import run_update
from dips.spec import OuterConfig, PenaltyConfig
from tests.roles.test_hostile_leader import FakeFollower

CFG, OUTER = PenaltyConfig(), OuterConfig()
BEFORE, AFTER = 40, 250  # honest rounds of all three before the attack; of two after it


class Parts(FakeFollower):
    """A follower whose clusters pushed Δ_j = a_j·u + b_j·v_j (``parts[j] = (a_j, b_j)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: dict[str, tuple[float, float]] = {}

    def score(self, rnd, clusters, push_ids=None, retired=None):
        return [(c, True, a * a + b * b, "") for c, (a, b) in
                ((c, self.parts[c]) for c in clusters)]

    def aggregate(self, rnd, clusters, weights):
        common = sum(w * self.parts[c][0] for c, w in zip(clusters, weights))
        return common * common + sum((w * self.parts[c][1]) ** 2 for c, w in zip(clusters, weights))


def honest(seed: int, rnd: int, i: int, k: float = 1.0) -> tuple[float, float]:
    """Cluster i's (a, b) in round ``rnd``, its pseudo-gradient multiplied by ``k``."""
    g = math.exp(0.5 * random.Random(seed * 1000003 + rnd * 7 + i).gauss(0.0, 1.0) - 0.125)
    return k * math.sqrt(0.8 * g), k * math.sqrt(0.2 * g)


def bound_of(state: PenaltyState, outer: OuterConfig) -> float | None:
    """The largest G that enters the statistics and the mean whole this round
    (:func:`dips.algo.aggregate.push_bound`), computed here so that the test runs on the old
    code too."""
    mu_r = robust_mu(state, 3)
    return None if mu_r is None else outer.push_norm_ratio ** 2 * mu_r


def run(seed: int, mode: str, edge_rounds: int = 0, outer: OuterConfig = OUTER) -> list[dict]:
    """Rounds of honest a, b and member h: h pushes honestly for BEFORE rounds, then with
    ``mode`` "ratchet" ratchets until its first refusal or its 11th accepted push, with "edge"
    pushes G = the bound (:func:`bound_of`: the largest push that enters the mean whole, an
    honest-looking one) for ``edge_rounds`` rounds, with "control" nothing, and leaves; AFTER
    rounds of a and b alone follow (AFTER + ``edge_rounds`` for "control"). One record per
    round."""
    follower, state, k, phase, out = Parts(), PenaltyState(), 1.0, "before", []
    accepted = 0
    rnd = 0
    length = AFTER + (edge_rounds if mode == "control" else 0)
    while phase != "after" or rnd < out[-1]["left"] + length:
        rnd += 1
        follower.parts = {c: honest(seed, rnd, i) for i, c in enumerate("ab")}
        if phase == "attack" and mode == "edge":
            a, b = honest(seed, rnd, 2)
            bound = bound_of(state, outer)
            follower.parts["h"] = honest(seed, rnd, 2, math.sqrt(bound / (a * a + b * b)))
        elif phase != "after":
            follower.parts["h"] = honest(seed, rnd, 2, k)
        slots = [Slot(c, f"{rnd:08x}{i:08x}", rnd - 1, 100, 0.0, round=rnd, admitted_at=0.0,
                      done=True, ok=True) for i, c in enumerate(sorted(follower.parts))]
        bound = bound_of(state, outer)
        pooled = state.pooled(CFG)
        report = run_update([(0, follower)], rnd, slots, rnd - 1, state, CFG, outer, members=3)
        assert not report.failed
        state = report.penalty
        # h's score in the stack, if it entered it this round, and the bound's score.
        new = state.recent[len(state.recent) - len(report.outcome.accepted):]
        entered = [e for c, e in new if c == "h" and report.outcome.thresholds]
        mu_r = robust_mu(state, 3, 1.0)
        rec = {"phase": phase, "step": report.outcome.clip_factor * math.sqrt(report.delta_sq_norm),
               "mu": state.mu, "sigma": state.pooled(CFG)[1],
               "threshold": report.outcome.thresholds.get("a", 0.0),
               "cap_binds": state.mu > outer.push_norm_ratio ** 2 * mu_r,
               "bound": bound, "h_score": entered[0] if entered else None,
               "bound_score": None if bound is None or pooled is None else
               (bound - pooled[0]) / pooled[1],
               "h_mean": state.sources["h"].a / state.sources["h"].w,
               "left": out[-1]["left"] if out else None}
        out.append(rec)
        if phase == "before" and rnd == BEFORE:
            phase = "after" if mode == "control" else "attack"
            rec["left"] = rnd if mode == "control" else None
        elif phase == "attack":
            if "h" in report.outcome.accepted:
                k, accepted = k * 1.6, accepted + 1
            if mode == "ratchet" and ("h" not in report.outcome.accepted or accepted == 11) \
                    or mode == "edge" and rnd == BEFORE + edge_rounds:
                phase, rec["left"] = "after", rnd
    return out


@pytest.mark.parametrize("seed", [3, 5])
def test_a_ratcheting_member_moves_no_step_and_no_statistic_for_long(seed):
    attacked, control = run(seed, "ratchet"), run(seed, "control")
    # Round by round against the same honest pushes without the attack (h left at BEFORE).
    ratios = [(a["phase"], a["step"] / c["step"]) for a, c in zip(attacked, control)][BEFORE:]
    during = [r for phase, r in ratios if phase == "attack"]
    after = [r for phase, r in ratios if phase == "after"]
    binds = sum(a["cap_binds"] for a in attacked if a["phase"] == "after")
    # The old code: 11 accepted, then 2.1-2.2x for ~190 rounds, the clip's μ at its cap of
    # 4 μ_robust (the pooled μ 360-570) in 115-130 of them.
    assert max(during + after) <= 1.1, (
        f"{len(during)} rounds of attack; steps up to {max(during):.2f}x during, "
        f"{max(after):.2f}x after ({sum(r > 1.1 for r in after)} of {len(after)} rounds over "
        f"1.1x); the clip's μ = 4 μ_robust (cap) in {binds} of the rounds after")
    assert len(during) <= 4
    # Each G of h entered the statistics at most at the bound, each score the stack at most as
    # the bound's (the old code: h's own mean 1,100-1,700 where the bound was at most 5.2, its
    # stack scores up to 29-47 where the bound's were at most 7-16), so μ stays within a tenth
    # of the honest run's and σ and the threshold within twice (the old code: μ 360-570
    # against 1.14, σ 1,700-2,900 against 0.6-0.7, the threshold 86-142 against 13-15).
    assert max(a["h_mean"] for a in attacked) <= max(a["bound"] or 0 for a in attacked)
    assert all(a["h_score"] <= a["bound_score"] + 1e-12 for a in attacked
               if a["h_score"] is not None and a["bound"] is not None)
    assert max(a["mu"] for a in attacked) <= 1.1 * max(c["mu"] for c in control)
    for stat in ("sigma", "threshold"):
        assert max(a[stat] for a in attacked) <= 2 * max(c[stat] for c in control), stat
    # Before the attack the steps are the clip's of the honest scale, 0.4 · √μ ≈ 0.4.
    before = [a["step"] for a in attacked[20:BEFORE]]
    assert sum(before) / len(before) == pytest.approx(0.4, rel=0.05)


@pytest.mark.parametrize("ratio", [2.0, None])
def test_the_leader_bounds_what_enters_the_statistics_by_the_history_before_the_step(ratio):
    """Hand-computed: three members own means 1 (σ = 2 pooled, so the threshold 3 accepts up
    to G = 7); h's 6 is accepted and enters μ, σ and the stack as 2² · μ_robust = 4, as if h had
    pushed 4 (E = 1.5, not 2.5). ``push_norm_ratio: null`` leaves §8 as written."""
    share = Moments(1 / 3, 1 / 3, 5 / 3)  # mean 1, second moment 1 + 2²
    state = PenaltyState(100, {c: share for c in ("a", "b", "h")}, [])
    follower = Parts()
    follower.parts = {"a": (1.0, 0.0), "b": (0.0, 1.0), "h": (math.sqrt(6.0), 0.0)}
    slots = [Slot(c, f"{i:016x}", 0, 100, 0.0, round=1, admitted_at=0.0, done=True, ok=True)
             for i, c in enumerate("abh")]
    report = run_update([(0, follower)], 1, slots, 0, state, CFG,
                        OuterConfig(push_norm_ratio=ratio), members=3)
    assert report.outcome.accepted == ("a", "b", "h")
    assert report.outcome.scores["h"] == pytest.approx(2.5, rel=1e-12)
    entered = {**report.sq_norms, **({"h": 4.0} if ratio else {})}
    assert report.penalty == decide(state, entered, CFG)[1]
    assert report.penalty.recent[-1][0] == "h"
    assert report.penalty.recent[-1][1] == pytest.approx((entered["h"] - 1.0) / 2.0, rel=1e-12)
