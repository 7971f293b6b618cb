"""The round's token-weighted sum formed at receipt, and the spare state of the two-phase step.

Checks (§6, §8, §10 of the seed): S = Σ T_j·Δ_j does not depend on arrival order; it serves
the update only when the accepted set and weights are exactly the round's contributors and
T_j/ΣT; the follower's outer step through it (and through every fallback) equals
torch.optim.SGD(nesterov=True) on the token-weighted mean; abort and restore leave the
current version intact and the next step still correct.
"""

from __future__ import annotations

import pytest
import torch

from dips.algo import token_weights, weighted_mean
from dips.roles.follower import FollowerShard
from dips.roles.round_sum import RoundSum
from dips.wire.frames import tensor_bytes
from dips.wire.stream import TensorSpec

pytestmark = pytest.mark.timeout(60)

SHAPES = {"big": (1100, 1000), "small": (3, 5)}  # "big" spans two norm blocks
LAYERS = {"l0": ["big"], "l1": ["small"]}


def _theta(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _local(theta: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (t + 0.05 * torch.randn(t.shape, generator=g)).to(torch.bfloat16)
            for n, t in theta.items()}


def _push(shard: FollowerShard, rnd: int, cluster: str, local: dict[str, torch.Tensor],
          tokens: int | None, chunk: int = 1 << 16) -> None:
    """Stream every layer of a push into the shard as the data plane does (chunks)."""
    for layer, names in shard.layers.items():
        specs = [TensorSpec.of(n, local[n]) for n in names]
        sink = shard.open_push({"op": "push", "cluster": cluster, "round": rnd, "layer": layer,
                                "tokens": tokens}, specs)
        for i, n in enumerate(names):
            raw = tensor_bytes(local[n])
            for off in range(0, len(raw), chunk):
                sink.write(i, off, raw[off:off + chunk])
        sink.commit()


def _step(shard: FollowerShard, rnd: int, clusters: list[str], weights: list[float]) -> float:
    """One outer step on the shard; returns the scale folded into it (1/ΣT: the sum served)."""
    for c, valid, _, err in shard.score(rnd, clusters):
        assert valid, err
    sq = shard.aggregate(rnd, clusters, weights)
    scale = shard._mean[rnd].scale
    clip = min(1.0, 1.0 / sq ** 0.5)
    shard.apply(rnd, clip, shard.version + 1, clusters, weights)
    shard.commit(shard.version + 1)
    return scale


def _reference(theta, locals_, weights, momenta=None):
    """SGD(nesterov) on δ = Σ w_j (θ − θ_j), clipped to norm 1; returns (θ', momentum)."""
    ref = {n: t.clone().requires_grad_(True) for n, t in theta.items()}
    delta = {n: sum(w * (theta[n] - loc[n].float()) for w, loc in zip(weights, locals_))
             for n in theta}
    norm = torch.sqrt(sum((d.double() ** 2).sum() for d in delta.values())).item()
    opt = torch.optim.SGD(list(ref.values()), lr=0.7, momentum=0.8, nesterov=True)
    for n, p in ref.items():
        p.grad = delta[n] * min(1.0, 1.0 / norm)
    opt.step()
    mom = {n: opt.state[p]["momentum_buffer"] for n, p in ref.items()}
    return {n: p.detach() for n, p in ref.items()}, mom


def test_sum_is_independent_of_arrival_order_and_matches_the_weighted_mean():
    theta = _theta()
    deltas = {c: {n: theta[n] - _local(theta, s)[n].float() for n in SHAPES}
              for c, s in (("a", 1), ("b", 2), ("c", 3))}
    tokens = {"a": 300, "b": 100, "c": 50}
    sums = []
    for order in (["a", "b", "c"], ["c", "a", "b"], ["b", "c", "a"]):
        bufs: list[dict[str, torch.Tensor]] = []

        def acquire():
            bufs.append({n: torch.empty(s) for n, s in SHAPES.items()})
            return bufs[-1]

        rs = RoundSum(SHAPES, acquire, lambda b: None)
        for c in order:
            rs.announce(c, tokens[c])
        for c in order:  # layers complete in this order, cluster by cluster
            for names in LAYERS.values():
                rs.layer_done(c, names, lambda cl, n: deltas[cl][n])
        w = token_weights(tokens, ["a", "b", "c"])
        got = rs.mean(["a", "b", "c"], [w["a"], w["b"], w["c"]], list(SHAPES))
        assert got is not None and len(bufs) == 1
        sums.append(got)
    tensors, scale, sq = sums[0]
    for other in sums[1:]:  # bit for bit, whatever the order
        assert other[1] == scale and other[2] == sq
        assert all(torch.equal(x, y) for x, y in zip(other[0], tensors))
    assert scale == 1 / 450
    mean = weighted_mean([[deltas[c][n] for n in SHAPES] for c in "abc"],
                         [tokens[c] / 450 for c in "abc"])
    for s, m in zip(tensors, mean):
        torch.testing.assert_close(s * scale, m, rtol=1e-5, atol=1e-7)
    expected = sum(float((m.double() ** 2).sum()) for m in mean)
    assert sq == pytest.approx(expected, rel=1e-5)


def test_sum_serves_only_the_exact_contributors_and_token_weights():
    theta = _theta()
    d = {c: {n: theta[n] - _local(theta, s)[n].float() for n in SHAPES} for c, s in (("a", 1), ("b", 2))}
    rs = RoundSum(SHAPES, lambda: {n: torch.empty(s) for n, s in SHAPES.items()}, lambda b: None)
    rs.announce("a", 300)
    rs.announce("b", 100)
    rs.layer_done("a", ["big", "small"], lambda c, n: d[c][n])
    rs.layer_done("b", ["big"], lambda c, n: d[c][n])
    assert rs.mean(["a", "b"], [0.75, 0.25], list(SHAPES)) is None  # b is incomplete
    rs.layer_done("b", ["small"], lambda c, n: d[c][n])
    assert rs.mean(["a", "b"], [0.75, 0.25], list(SHAPES)) is not None
    assert rs.mean(["a", "b"], [0.5, 0.5], list(SHAPES)) is None  # uniform-weights ablation
    assert rs.mean(["a"], [1.0], list(SHAPES)) is None  # b rejected: form δ from Δ_a
    with pytest.raises(ValueError, match="'tokens' = -3"):
        rs.announce("c", -3)
    rs.announce("c", None)
    assert rs.unusable and rs.mean(["a", "b"], [0.75, 0.25], list(SHAPES)) is None


@pytest.mark.parametrize("tokens, accepted", [
    ({"a": 300, "b": 100}, ["a", "b"]),   # the sum formed at receipt
    ({"a": 300, "b": None}, ["a", "b"]),  # b sent no token count: δ formed when asked
    ({"a": 300, "b": 100}, ["a"]),        # b rejected: δ = Δ_a
])
def test_follower_step_equals_sgd_nesterov_on_every_path(tmp_path, tokens, accepted):
    theta = _theta()
    shard = FollowerShard(0, LAYERS, theta, ckpt_dir=tmp_path / "ckpt")
    locals_ = {"a": _local(theta, 1), "b": _local(theta, 2)}
    for c in ("b", "a"):
        _push(shard, 1, c, locals_[c], tokens[c])
    t = {c: tokens[c] or 100 for c in accepted}
    w = token_weights(t, accepted)
    scale = _step(shard, 1, accepted, [w[c] for c in accepted])
    assert (scale == 1 / 400) == (accepted == ["a", "b"] and tokens["b"] is not None)
    ref, mom = _reference(theta, [locals_[c] for c in accepted], [w[c] for c in accepted])
    for n in SHAPES:
        torch.testing.assert_close(shard.params[n], ref[n], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(shard.momenta[n], mom[n], rtol=1e-5, atol=1e-6)
    shard.close()


def test_abort_and_restore_keep_the_current_version_and_the_next_step_correct(tmp_path):
    theta = _theta()
    shard = FollowerShard(0, LAYERS, theta, ckpt_dir=tmp_path / "ckpt")
    before = shard.state()[2]
    loc = _local(theta, 1)
    _push(shard, 1, "a", loc, 100)
    shard.score(1, ["a"])
    shard.aggregate(1, ["a"], [1.0])
    shard.apply(1, 0.5, 1, ["a"], [1.0])
    shard.abort(1)  # the prepared buffers were stepped in place: current θ must be untouched
    assert shard.version == 0 and shard.state()[2] == before
    _push(shard, 2, "a", loc, 100)
    _step(shard, 2, ["a"], [1.0])
    ref, _ = _reference(theta, [loc], [1.0])
    for n in SHAPES:
        torch.testing.assert_close(shard.params[n], ref[n], rtol=1e-5, atol=1e-6)
    after_one = shard.state()[2]
    _push(shard, 3, "a", _local(theta, 7), 100)
    _step(shard, 3, ["a"], [1.0])
    assert shard._writer.wait(2, 10)
    shard.restore(1)  # roll back to the checkpoint of version 1, then step again from it
    assert shard.version == 1 and shard.state()[2] == after_one
    _push(shard, 4, "a", loc, 100)
    _step(shard, 4, ["a"], [1.0])
    assert shard.version == 2
    shard.close()
