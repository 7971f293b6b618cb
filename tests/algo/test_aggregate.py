"""Tests of token weighting, weighted mean, norms and the clip factor (§8, §11 of the seed)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dips.algo.aggregate import clip_factor, squared_norm, token_weights, weighted_mean


def test_seed_section_11_aggregation():
    w = token_weights({"A": 32_000, "B": 64_000, "C": 10}, ["A", "B"])
    assert w == pytest.approx({"A": 1 / 3, "B": 2 / 3}, rel=1e-15)
    delta_a = [torch.tensor([0.2, 0.4])]
    delta_b = [torch.tensor([0.5, 0.1])]
    (delta,) = weighted_mean([delta_a, delta_b], [w["A"], w["B"]])
    torch.testing.assert_close(delta, torch.tensor([0.4, 0.2]), rtol=0, atol=1e-7)
    sq = squared_norm([delta])
    assert math.sqrt(sq) == pytest.approx(0.4472, abs=1e-4)
    assert clip_factor(sq) == 1.0  # ||δ|| < 1: not clipped


def test_seed_section_11_is_not_clipped_under_either_clip_rule():
    from dips.algo import clip_threshold
    from dips.algo.penalty import PenaltyConfig, PenaltyState, decide
    from dips.spec import OuterConfig

    sq = 0.4 ** 2 + 0.2 ** 2  # ‖δ‖² of the §11 example
    seed = OuterConfig(clip="seed")
    assert clip_threshold(seed.clip, seed.max_norm, seed.clip_ratio, None) == 1.0
    assert clip_factor(sq, 1.0) == 1.0
    # The default relative rule: μ = 4.5 before the step, then the §8 EMA (α = 0.02) over
    # G_A = 4, G_B = 5 and the rejected G_C = 81 winsorized to μ + 6σ = 10.5 (the largest G
    # the step accepts), in id order: 4.49, 4.5002, 4.620196; c = 0.4·√μ = 0.859786.
    default = OuterConfig()
    assert (default.clip, default.clip_ratio) == ("relative", 0.4)
    mu = 4.5
    for g in (4.0, 5.0, 10.5):
        mu = 0.02 * g + 0.98 * mu
    assert mu == pytest.approx(4.620196, abs=1e-9)
    _, state = decide(PenaltyState.from_moments(4.5, 1.0, 1000, [0.3, 2.0, -1.0]),
                      {"A": 4.0, "B": 5.0, "C": 81.0}, PenaltyConfig())
    assert state.mu == pytest.approx(mu, rel=1e-12)
    c = clip_threshold(default.clip, default.max_norm, default.clip_ratio, mu)
    assert c == pytest.approx(0.859786, abs=1e-6)
    assert clip_factor(sq, c) == 1.0  # ‖δ‖ ≈ 0.447 < 0.860: not clipped either


def test_clipping_above_max_norm():
    delta = [torch.tensor([3.0, 4.0])]
    factor = clip_factor(squared_norm(delta))
    assert factor == pytest.approx(0.2, rel=1e-15)
    assert math.sqrt(squared_norm([delta[0] * factor])) == pytest.approx(1.0, rel=1e-6)
    assert clip_factor(25.0, max_norm=2.5) == pytest.approx(0.5)
    assert clip_factor(1.0) == 1.0  # exactly at the bound


def test_clip_disabled_and_zero_norm():
    assert clip_factor(1e12, max_norm=None) == 1.0
    assert clip_factor(1e12, max_norm=math.inf) == 1.0
    assert clip_factor(0.0) == 1.0


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_clip_factor_rejects_bad_norm(bad):
    with pytest.raises(ValueError, match="total_sq_norm.*" + repr(bad)):
        clip_factor(bad)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan])
def test_clip_factor_rejects_bad_max_norm(bad):
    with pytest.raises(ValueError, match="max_norm"):
        clip_factor(4.0, max_norm=bad)


def test_sharded_norms_add_up_to_full_model_norm():
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(7, 5, generator=gen), torch.randn(11, generator=gen),
            torch.randn(3, 2, 2, generator=gen)]
    shard0, shard1 = full[:1], full[1:]
    total = squared_norm(shard0) + squared_norm(shard1)
    expected = sum(float((t.double() ** 2).sum()) for t in full)
    assert total == pytest.approx(expected, rel=1e-12)
    assert squared_norm(full) == pytest.approx(expected, rel=1e-12)
    assert squared_norm([]) == 0.0


def test_squared_norm_blocked_accumulation_and_chunking():
    # 3M equal elements (3 blocks, the worst case for FP32 rounding): one FP32 accumulator
    # drifts by ~1e-3 here; FP32 rows of 512 summed in float64 stay within 1e-6.
    t = torch.full((3_000_000,), 0.1, dtype=torch.float32)
    expected = 3_000_000 * float(torch.tensor(0.1, dtype=torch.float32)) ** 2
    assert squared_norm([t]) == pytest.approx(expected, rel=1e-6)
    assert squared_norm([t.view(1000, 3000).t()]) == pytest.approx(expected, rel=1e-6)
    odd = torch.randn(1_000_003, generator=torch.Generator().manual_seed(1))  # row + tail
    assert squared_norm([odd]) == pytest.approx(float((odd.double() ** 2).sum()), rel=1e-7)
    assert squared_norm([odd]) == squared_norm([odd.clone()])  # bit for bit
    bf = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    assert squared_norm([bf]) == 6.25
    with pytest.raises(ValueError, match=r"tensors\[1\].*int64"):
        squared_norm([bf, torch.tensor([1, 2])])


def test_token_weights_uniform_ablation():
    w = token_weights({"A": 1, "B": 999, "C": 5}, ["C", "A"], uniform=True)
    assert w == {"C": 0.5, "A": 0.5}
    assert list(w) == ["C", "A"]


@pytest.mark.parametrize(
    "tokens,accepted,match",
    [
        ({"A": 1}, [], "accepted"),
        ({"A": 1}, ["B"], "'B'"),
        ({"A": 0}, ["A"], r"tokens\['A'\].*0"),
        ({"A": -5}, ["A"], r"tokens\['A'\].*-5"),
        ({"A": 1.5}, ["A"], r"tokens\['A'\].*1.5"),
        ({"A": 1}, ["A", "A"], "duplicate"),
    ],
)
def test_token_weights_errors(tokens, accepted, match):
    with pytest.raises(ValueError, match=match):
        token_weights(tokens, accepted)


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.sampled_from("ABCDEFGH"), st.integers(1, 10**12), min_size=1))
def test_token_weights_sum_to_one_and_proportional(tokens):
    ids = sorted(tokens)
    w = token_weights(tokens, ids)
    assert math.fsum(w.values()) == pytest.approx(1.0, rel=1e-12)
    total = sum(tokens.values())
    for cid in ids:
        assert w[cid] == pytest.approx(tokens[cid] / total, rel=1e-15)


def test_weighted_mean_matches_reference_and_does_not_modify_inputs():
    gen = torch.Generator().manual_seed(1)
    shapes = [(4, 3), (5,), (2, 2, 2), ()]
    deltas = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    copies = [[t.clone() for t in ts] for ts in deltas]
    weights = [0.5, 0.25, 0.25]
    out = weighted_mean(deltas, weights)
    for k in range(len(shapes)):
        ref = sum(w * d[k].double() for w, d in zip(weights, deltas)).float()
        assert out[k].dtype == torch.float32 and out[k].shape == ref.shape
        torch.testing.assert_close(out[k], ref, rtol=1e-6, atol=1e-7)
        assert all(out[k] is not d[k] for d in deltas)
    for ts, cs in zip(deltas, copies):
        for t, c in zip(ts, cs):
            assert torch.equal(t, c)


def test_weighted_mean_errors_name_index_and_shapes():
    a = [torch.zeros(2, 3), torch.zeros(4)]
    with pytest.raises(ValueError, match=r"tensor 1.*\(5,\).*\(4,\)"):
        weighted_mean([a, [torch.zeros(2, 3), torch.zeros(5)]], [0.5, 0.5])
    with pytest.raises(ValueError, match=r"deltas\[1\]\[0\].*float64"):
        weighted_mean([a, [torch.zeros(2, 3, dtype=torch.float64), torch.zeros(4)]], [0.5, 0.5])
    with pytest.raises(ValueError, match="len"):
        weighted_mean([a], [0.5, 0.5])
    with pytest.raises(ValueError, match=r"deltas\[1\] has 1 tensors"):
        weighted_mean([a, a[:1]], [0.5, 0.5])
    with pytest.raises(ValueError, match=r"weights\[0\]"):
        weighted_mean([a], [math.nan])
    with pytest.raises(ValueError, match="non-empty"):
        weighted_mean([], [])


def test_clip_threshold_seed_is_the_fixed_norm_relative_follows_the_penalty_history():
    from dips.algo import clip_threshold

    assert clip_threshold("seed", 1.0, 0.2, 400.0) == 1.0
    assert clip_threshold("seed", None, 0.2, 400.0) is None  # the no-clip ablation
    # relative: 0.2 × √400 = 4.0, so a ‖δ‖ of 20 is scaled by 4/20 = 0.2, one of 3 not at all.
    assert clip_threshold("relative", 1.0, 0.2, 400.0) == pytest.approx(4.0)
    assert clip_factor(400.0, clip_threshold("relative", 1.0, 0.2, 400.0)) == pytest.approx(0.2)
    assert clip_factor(9.0, clip_threshold("relative", 1.0, 0.2, 400.0)) == 1.0
    assert clip_threshold("relative", 1.0, 0.2, None) is None  # no history yet: no clip
    assert clip_threshold("relative", 1.0, 0.2, 0.0) is None
    for bad in (("other", 1.0, 0.2, 1.0), ("relative", 1.0, 0.0, 1.0),
                ("relative", 1.0, 0.2, float("nan")), ("relative", 1.0, 0.2, -1.0)):
        with pytest.raises(ValueError):
            clip_threshold(*bad)


def test_staleness_scale_inverse_of_the_token_weighted_staleness():
    from dips.algo import staleness_scale

    w = {"a": 0.75, "b": 0.25}
    assert staleness_scale("none", w, {"a": 5, "b": 9}) == 1.0  # the seed
    assert staleness_scale("inverse", w, {"a": 0, "b": 0}) == 1.0  # fresh: a DiLoCo step
    # s̄ = 0.75·1 + 0.25·5 = 2 -> 1/3
    assert staleness_scale("inverse", w, {"a": 1, "b": 5}) == pytest.approx(1 / 3)
    for bad in (("other", w, {"a": 0, "b": 0}), ("inverse", w, {"a": 0}),
                ("inverse", w, {"a": -1, "b": 0})):
        with pytest.raises(ValueError):
            staleness_scale(*bad)


def test_token_weights_cap_each_push_at_the_most_one_push_trains():
    # Issue 13: a member reporting 10x the windows of a full push weighs one full push.
    w = token_weights({"a": 2048, "b": 1024, "h": 20480}, ["a", "b", "h"], cap=2048)
    assert w == {"a": 0.4, "b": 0.2, "h": 0.4}
    assert token_weights({"a": 2048, "b": 1024}, ["a", "b"], cap=4096) == \
        token_weights({"a": 2048, "b": 1024}, ["a", "b"])
    with pytest.raises(ValueError, match="cap"):
        token_weights({"a": 1}, ["a"], cap=0)
