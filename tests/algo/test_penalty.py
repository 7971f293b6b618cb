"""Tests of the pseudo-gradient penalty (§8, §11 of the seed)."""

from __future__ import annotations

import copy
import json
import math
import re
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dips.algo.penalty import Moments, PenaltyConfig, PenaltyState, Verdict, decide, robust_mu

CFG = PenaltyConfig()


def scored_state(mu: float = 4.5, sigma: float = 1.0, recent=(0.3, 2.0, -1.0)) -> PenaltyState:
    """A state well past warm-up, as in the §11 example (no history owned by a cluster)."""
    return PenaltyState.from_moments(mu, sigma, 1000, list(recent))


def sigma(state: PenaltyState, cfg: PenaltyConfig = CFG) -> float:
    return state.pooled(cfg)[1]


def scores_of(state: PenaltyState) -> list[float]:
    return [s for _, s in state.recent]


def test_seed_section_11_example_exactly():
    verdict, new = decide(scored_state(), {"A": 4.0, "B": 5.0, "C": 81.0}, CFG)
    assert verdict.thresholds == {"A": 6.0, "B": 6.0, "C": 6.0}
    assert verdict.scores == {"A": -0.5, "B": 0.5, "C": 76.5}
    assert verdict.accepted == ["A", "B"]
    assert verdict.rejected == ["C"]
    assert new.n_seen == 1003
    # Only accepted scores enter the history.
    assert new.recent == [("", 0.3), ("", 2.0), ("", -1.0), ("A", -0.5), ("B", 0.5)]


def test_ema_one_value_hand_computed():
    _, new = decide(scored_state(), {"A": 4.0}, CFG)
    # mu' = 0.02*4 + 0.98*4.5 = 4.49; second moment 0.98*(1 + 4.5^2) + 0.02*4^2 = 21.145,
    # sigma'^2 = 21.145 - 4.49^2 = 0.9849 = 0.98*1 + 0.02*0.98*(4-4.5)^2 (West 1979)
    assert new.mu == pytest.approx(4.49, rel=1e-12)
    assert sigma(new) == pytest.approx(math.sqrt(0.9849), rel=1e-12)


def test_ema_two_values_hand_computed_in_cluster_id_order():
    # Dict order B, A must not matter: updates run in sorted id order (A=4 then B=5).
    _, new = decide(scored_state(), {"B": 5.0, "A": 4.0}, CFG)
    # after A: mu=4.49, sigma^2=0.9849
    # after B: mu = 0.1 + 0.98*4.49 = 4.5002
    #          sigma^2 = 0.98*0.9849 + 0.02*0.98*(5-4.49)^2 = 0.965202 + 0.00509796
    assert new.mu == pytest.approx(4.5002, rel=1e-12)
    assert sigma(new) == pytest.approx(math.sqrt(0.97029996), rel=1e-12)


def test_rejected_value_updates_mu_sigma_winsorized_to_the_acceptance_bound():
    _, new = decide(scored_state(), {"A": 4.0, "B": 5.0, "C": 81.0}, CFG)
    # after A, B as above; then C = 81 counts as the largest G this step accepts,
    # mu_t + threshold * sigma_t = 4.5 + 6 * 1 = 10.5: mu = 0.02*10.5 + 0.98*4.5002 = 4.620196
    assert new.mu == pytest.approx(4.620196, rel=1e-12)
    var = 0.98 * 0.97029996 + 0.02 * 0.98 * (10.5 - 4.5002) ** 2
    assert sigma(new) == pytest.approx(math.sqrt(var), rel=1e-12)


@pytest.mark.parametrize("g", [81.0, 1e6, 1e150])
def test_a_rejected_outlier_moves_the_statistics_as_much_as_the_largest_accepted_push(g):
    # Issue 13: whatever a hostile member's G, mu / sigma move exactly as if it had sent the
    # largest G the step accepts (10.5 here), never further; the next threshold is unchanged.
    _, at_bound = decide(scored_state(), {"A": 4.0, "H": 10.5}, CFG)
    verdict, new = decide(scored_state(), {"A": 4.0, "H": g}, CFG)
    assert verdict.rejected == ["H"]
    assert new.sources == at_bound.sources
    assert scores_of(new) == [0.3, 2.0, -1.0, -0.5]
    assert decide(new, {"A": 4.0}, CFG)[0].thresholds["A"] == 6.0


# 1e200: finite, but its square overflows the second moment (the statistics never take it).
@pytest.mark.parametrize("bad", [math.nan, math.inf, 1e200, 1.7e308])
@pytest.mark.parametrize("enabled", [True, False])
def test_a_non_finite_norm_rejects_that_cluster_alone(bad, enabled):
    # Issue 13: one overflowed pseudo-gradient used to make decide raise, failing the round of
    # every cluster; now it is rejected alone (even with the penalty disabled) and never
    # enters the statistics.
    cfg = PenaltyConfig(enabled=enabled)
    verdict, new = decide(scored_state(), {"A": 4.0, "B": 5.0, "C": bad}, cfg)
    ref_verdict, ref = decide(scored_state(), {"A": 4.0, "B": 5.0}, cfg)
    assert verdict.accepted == ["A", "B"] and verdict.rejected == ["C"]
    assert verdict.scores["C"] == math.inf
    assert new == ref
    warm, state = decide(PenaltyState(), {"A": 4.0, "C": bad}, cfg)
    assert warm.accepted == ["A"] and warm.rejected == ["C"] and state.n_seen == 1
    alone, same = decide(PenaltyState(), {"C": bad}, cfg)
    assert alone.accepted == [] and same == PenaltyState()


def test_outlier_does_not_raise_next_threshold():
    v1, s1 = decide(scored_state(), {"A": 4.0, "C": 81.0}, CFG)
    assert v1.rejected == ["C"]
    v2, _ = decide(s1, {"A": 4.0}, CFG)
    assert v2.thresholds == {"A": 6.0}


def test_warmup_accepts_everything_then_mean_and_population_std():
    cfg = PenaltyConfig(warmup=3)
    state = PenaltyState()
    for g in (1.0, 1000.0, 2.0):
        verdict, state = decide(state, {"x": g}, cfg)
        assert verdict == Verdict(["x"], [], {"x": None}, {})
    assert state.n_seen == 3
    assert state.mu == pytest.approx(statistics.fmean([1.0, 1000.0, 2.0]), rel=1e-12)
    assert sigma(state, cfg) == pytest.approx(statistics.pstdev([1.0, 1000.0, 2.0]), rel=1e-12)
    assert state.recent == []
    verdict, _ = decide(state, {"x": 5000.0}, cfg)
    assert verdict.scores["x"] is not None
    assert verdict.rejected == ["x"]


def test_warmup_counts_values_before_the_step():
    cfg = PenaltyConfig(warmup=3)
    state = PenaltyState.from_moments(1.0, 1.0, 2)  # values 0 and 2
    verdict, new = decide(state, {"a": 10.0, "b": 100.0, "c": 4.0}, cfg)
    assert verdict.accepted == ["a", "b", "c"] and verdict.thresholds == {}
    assert new.n_seen == 5
    values = [0.0, 2.0, 10.0, 100.0, 4.0]
    assert new.mu == pytest.approx(statistics.fmean(values), rel=1e-12)
    assert sigma(new, cfg) == pytest.approx(statistics.pstdev(values), rel=1e-12)
    scored, _ = decide(new, {"a": 1.0}, cfg)
    assert scored.thresholds == {"a": 3.0}


def test_sigma_floors():
    cfg = PenaltyConfig(warmup=2)
    _, s = decide(PenaltyState(), {"a": 10.0, "b": 10.0}, cfg)
    assert sigma(s, cfg) == pytest.approx(0.5)  # 0.05 * mu, population std is 0
    _, z = decide(PenaltyState(), {"a": 0.0, "b": 0.0}, cfg)
    assert sigma(z, cfg) == 1e-12
    # EMA below the relative floor is raised back to it: sqrt(0.98*0.25) < 0.05*10.
    _, e = decide(PenaltyState.from_moments(10.0, 0.5, 50), {"a": 10.0}, cfg)
    assert sigma(e, cfg) == pytest.approx(0.5)


def test_threshold_floor_with_calm_or_empty_history():
    for recent in ([], [-2.0, -0.1, 0.0]):
        state = scored_state(mu=0.0, sigma=1.0, recent=recent)
        verdict, _ = decide(state, {"a": 2.9, "b": 3.0, "c": 3.1}, CFG)
        assert verdict.thresholds == {"a": 3.0, "b": 3.0, "c": 3.0}
        assert verdict.accepted == ["a", "b"]  # E == threshold is accepted
        assert verdict.rejected == ["c"]


def test_recent_scores_bounded():
    cfg = PenaltyConfig(recent=2)
    _, new = decide(scored_state(), {"A": 4.0, "B": 5.0}, cfg)
    assert new.recent == [("A", -0.5), ("B", 0.5)]


def test_only_last_recent_scores_count_after_config_change():
    # A checkpoint with a long history read under a smaller cfg.recent: old 50.0 is ignored.
    state = scored_state(recent=[50.0, 0.1, 1.5])
    verdict, new = decide(state, {"A": 4.0}, PenaltyConfig(recent=2))
    assert verdict.thresholds == {"A": 4.5}
    assert new.recent == [("", 1.5), ("A", -0.5)]


def test_disabled_accepts_all_but_scores_and_history_as_if_enabled():
    cfg = PenaltyConfig(enabled=False)
    verdict, new = decide(scored_state(), {"A": 4.0, "B": 5.0, "C": 81.0}, cfg)
    assert verdict.accepted == ["A", "B", "C"] and verdict.rejected == []
    assert verdict.scores["C"] == 76.5 and verdict.thresholds["C"] == 6.0
    _, enabled_state = decide(scored_state(), {"A": 4.0, "B": 5.0, "C": 81.0}, CFG)
    assert new == enabled_state


def test_inputs_not_mutated():
    state = scored_state()
    norms = {"A": 4.0, "B": 5.0, "C": 81.0}
    before = (copy.deepcopy(state), dict(norms))
    _, new = decide(state, norms, CFG)
    assert (state, norms) == before
    assert new is not state and new.recent is not state.recent and new.sources is not state.sources


@pytest.mark.parametrize("bad", [-1.0, "3", None])
def test_bad_norm_names_cluster_and_value(bad):
    state = scored_state()
    before = copy.deepcopy(state)
    with pytest.raises(ValueError, match=r"'C'.*" + re.escape(repr(bad))):
        decide(state, {"A": 4.0, "C": bad}, CFG)
    assert state == before


def test_other_bad_inputs():
    with pytest.raises(ValueError, match="sq_norms"):
        decide(scored_state(), {}, CFG)
    with pytest.raises(ValueError, match="cluster id"):
        decide(scored_state(), {3: 1.0}, CFG)
    with pytest.raises(ValueError, match="sources"):
        decide(PenaltyState(5, {}, []), {"a": 1.0}, CFG)
    with pytest.raises(ValueError, match="sum to 1"):
        decide(PenaltyState(5, {"": Moments(0.5, 0.5, 0.5)}, []), {"a": 1.0}, CFG)
    with pytest.raises(ValueError, match="sigma"):
        PenaltyState.from_moments(1.0, 0.0, 5)


@pytest.mark.parametrize(
    "field,value",
    [("alpha", 0.0), ("alpha", 1.5), ("beta", 0.0), ("warmup", 0), ("recent", 0),
     ("score_floor", 0.0), ("sigma_floor_rel", -0.1), ("alpha", math.nan), ("enabled", 1)],
)
def test_config_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        PenaltyConfig(**{field: value})


def test_state_dict_roundtrip_through_json():
    _, state = decide(scored_state(), {"A": 4.0, "B": 5.0}, CFG)
    back = PenaltyState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert back == state
    assert PenaltyState.from_dict(PenaltyState().to_dict()) == PenaltyState()
    with pytest.raises(ValueError, match="missing"):
        PenaltyState.from_dict({"n_seen": 1})
    with pytest.raises(ValueError, match="n_seen"):
        PenaltyState.from_dict({"mu": 1.0, "sigma": 1.0, "n_seen": -1, "recent_scores": []})
    with pytest.raises(ValueError, match=r"sources\['a'\]"):
        PenaltyState.from_dict({"n_seen": 1, "sources": {"a": [1.0, "x", 1.0]}, "recent": []})
    with pytest.raises(ValueError, match="w >= 0"):
        PenaltyState.from_dict({"n_seen": 1, "sources": {"a": [-1.0, 1.0, 1.0],
                                                         "b": [2.0, 1.0, 1.0]}, "recent": []})


def test_a_checkpoint_written_before_issue_13_reads_as_unattributed_history():
    old = {"mu": 4.5, "sigma": 1.0, "n_seen": 1000, "recent_scores": [0.3, 2.0, -1.0], "m2": 0.0}
    assert PenaltyState.from_dict(old) == scored_state()
    empty = {"mu": None, "sigma": None, "n_seen": 0, "recent_scores": [], "m2": 0.0}
    assert PenaltyState.from_dict(empty) == PenaltyState()


@settings(max_examples=60, deadline=None)
@given(
    norms=st.dictionaries(
        st.text(alphabet="abcdef", min_size=1, max_size=3),
        st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
        min_size=1,
        max_size=6,
    ),
    n_seen=st.integers(min_value=0, max_value=10),
)
def test_partition_of_clusters_and_sorted_output(norms, n_seen):
    state = PenaltyState() if n_seen == 0 else PenaltyState.from_moments(3.0, 2.0, n_seen)
    verdict, new = decide(state, norms, CFG)
    assert sorted(verdict.accepted + verdict.rejected) == sorted(norms)
    assert verdict.accepted == sorted(verdict.accepted)
    assert verdict.rejected == sorted(verdict.rejected)
    assert list(verdict.scores) == sorted(norms)
    assert new.n_seen == n_seen + len(norms)
    assert sigma(new) >= max(1e-12, 0.05 * new.mu)
    assert len(new.recent) <= CFG.recent
    assert new.total().w == pytest.approx(1.0, abs=1e-9)




def test_robust_mu_is_the_median_of_the_clusters_own_means_hand_computed():
    # Own means: a 1, b 3, c 2 (unattributed history does not vote).
    state = PenaltyState(10, {"a": Moments(0.25, 0.25, 0.25), "b": Moments(0.25, 0.75, 2.25),
                              "c": Moments(0.25, 0.5, 1.0), "": Moments(0.25, 25.0, 2500.0)},
                         [])
    assert robust_mu(state) == 2.0
    two = PenaltyState(10, {"a": Moments(0.5, 0.5, 0.5), "h": Moments(0.5, 500.0, 5e5)}, [])
    assert robust_mu(two) == 1.0                             # two clusters: the smaller mean
    assert robust_mu(scored_state()) == 4.5                  # no cluster owns history: pooled μ
    assert robust_mu(PenaltyState()) is None


def _owned(*means: float) -> PenaltyState:
    """A history whose clusters m0, m1, ... own the means ``means`` (equal masses)."""
    return PenaltyState(10, {f"m{i}": Moments(0.5, 0.5 * m, 0.5 * m * m)
                             for i, m in enumerate(means)}, [])


def test_robust_mu_waits_for_half_of_the_members_and_then_ranks_below_the_hostile_few():
    """Hand-computed ranks k − q of k own means among n members, q = max(⌈n/2⌉, min(2, n))."""
    # n = 1: the only member's own history; n = 2 (review 17, A: one member of two set the
    # scale and the steps were 5e9): both must have pushed, then the smaller mean.
    assert robust_mu(_owned(5.0), members=1, prior=1.0) == 5.0
    assert robust_mu(_owned(1e20), members=2, prior=1.0) == 1.0
    assert robust_mu(_owned(1e20, 2.0), members=2, prior=1.0) == 2.0
    # n = 3: one member's mean is nobody's scale (it may be the hostile one); two: the smaller.
    assert robust_mu(_owned(1e20), members=3, prior=1.0) == 1.0
    assert robust_mu(_owned(1e20), members=3) is None
    assert robust_mu(_owned(1e20, 2.0), members=3, prior=1.0) == 2.0
    assert robust_mu(_owned(1e20, 2.0, 3.0), members=3, prior=1.0) == 3.0   # lower median
    # n = 5 (at most 2 hostile): 3 means -> rank 0, 4 -> rank 1, 5 -> rank 2.
    assert robust_mu(_owned(9e9, 8e9, 1.0), members=5, prior=7.0) == 1.0
    assert robust_mu(_owned(9e9, 8e9, 1.0, 2.0), members=5) == 2.0
    assert robust_mu(_owned(9e9, 8e9, 1.0, 2.0, 3.0), members=5) == 3.0
    assert robust_mu(_owned(9e9, 8e9), members=5, prior=7.0) == 7.0
    # n = 4 (at most 1 hostile): 2 -> rank 0, 3 -> rank 1, 4 -> rank 2 (the upper median: one
    # member pushing near zero cannot shrink it either).
    assert robust_mu(_owned(9e9, 1.0), members=4) == 1.0
    assert robust_mu(_owned(9e9, 1.0, 2.0), members=4) == 2.0
    assert robust_mu(_owned(9e9, 1.0, 2.0, 3.0), members=4) == 3.0
    assert robust_mu(_owned(1e-9, 1.0, 2.0, 3.0), members=4) == 2.0
    # Members default to those in the history; fewer members than that count as that many.
    assert robust_mu(_owned(9e9, 1.0, 2.0)) == robust_mu(_owned(9e9, 1.0, 2.0), members=1)


@pytest.mark.parametrize("hostile", [["h"], ["h1", "h2"]])
def test_a_minority_just_under_the_threshold_cannot_lift_the_robust_scale(hostile):
    """The fresh reviews' input (2026-11-30, 2026-12-01): honest clusters with ‖Δ‖² near 1 and
    hostile ones that, every round, push 90% of the largest ‖Δ‖² the penalty accepts. §8's
    pooled μ and threshold follow them (a real run: threshold 3 -> 3,020, μ 2.35 -> 2.2e6 in
    12 pushes; with two colluders under leave-one-out scoring too), but the lower median of
    the clusters' own means stays honest, and it is what bounds each push and the clip."""
    honest = ["a", "b", "c"][: len(hostile) + 1]
    state = PenaltyState()
    for k in range(40):
        norms = {c: 1.0 + 0.05 * math.sin(k + i) for i, c in enumerate(honest)}
        if state.n_seen >= CFG.warmup:
            mu, sigma = state.pooled(CFG)
            threshold = CFG.beta * max([CFG.score_floor, *(e for _, e in state.recent)])
            norms.update({h: mu + 0.9 * threshold * sigma for h in hostile})
        else:
            norms.update({h: 1e6 for h in hostile})          # and poisoned the warm-up
        verdict, state = decide(state, norms, CFG)
    assert state.mu > 1e6                                    # §8's pooled μ is dragged up
    assert robust_mu(state) < 1.06                           # an honest cluster's mean


def test_one_cluster_alone_is_scored_against_its_own_history_as_section_8():
    alone = PenaltyState(1000, {"x": Moments(1.0, 4.5, 21.25)}, [("x", 2.0)])
    verdict, new = decide(alone, {"x": 81.0}, CFG)
    assert verdict.scores == {"x": 76.5} and verdict.thresholds == {"x": 6.0}
    assert verdict.rejected == ["x"]
    # 81 enters winsorized to 4.5 + 6 * 1 = 10.5: mu = 0.02 * 10.5 + 0.98 * 4.5
    assert new.mu == pytest.approx(4.62, rel=1e-12)


def test_a_cluster_that_left_is_folded_into_the_shared_history():
    state = PenaltyState(1000, {"gone": Moments(1.01e-9, 1.01e-9, 1.01e-9),
                                "x": Moments(1.0 - 1.01e-9, 1.0, 1.0)}, [])
    _, new = decide(state, {"x": 1.0}, CFG)
    assert sorted(new.sources) == ["", "x"]
    assert new.sources[""].w == pytest.approx(0.98 * 1.01e-9, rel=1e-9)
    assert new.total().w == pytest.approx(1.0, abs=1e-12)
