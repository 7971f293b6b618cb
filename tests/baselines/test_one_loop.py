"""The baselines on the one loop: their Δ is dips.algo.pseudo_gradient, their outer step the
replicated Nesterov step, and every engine builds a cluster with the same setup function."""

from __future__ import annotations

import pytest
import torch

from dips.algo import pseudo_gradient
from dips.baselines.real_common import OuterReplica
from dips.emu.vworld import World
from dips.spec import OuterConfig
from dips.train.trainer import build_trainer, sampler_seed
from tests.emu.vt_helpers import ROOT, tiny

pytestmark = pytest.mark.timeout(120)


def test_baseline_delta_is_pseudo_gradient_and_outer_step_is_nesterov():
    theta = [torch.tensor([1.0, 2.0, -3.0]), torch.tensor([[0.5]])]
    replica = OuterReplica(theta, OuterConfig(lr=0.5, momentum=0.8))
    local = [torch.tensor([0.75, 2.5, -3.0], requires_grad=True), torch.tensor([[0.25]])]
    delta = replica.pseudo_gradients(local)
    assert [d.tolist() for d in delta] == [[0.25, -0.5, 0.0], [[0.25]]]  # θ − θ_local, by hand
    assert all(torch.equal(d, pseudo_gradient(t, p)) for d, t, p in zip(delta, theta, local))
    # First Nesterov step: buf = Δ, θ −= lr·(Δ + momentum·buf) = θ − 0.5·1.8·Δ.
    replica.step(delta)
    replica.load_into(local)
    assert torch.allclose(local[0].detach(), torch.tensor([1.0 - 0.225, 2.0 + 0.45, -3.0]))
    assert torch.allclose(local[1], torch.tensor([[0.5 - 0.225]]))
    assert [t.tolist() for t in theta] == [[1.0, 2.0, -3.0], [[0.5]]]  # a copy, not the input


def test_virtual_world_and_setup_function_build_the_same_clusters(tmp_path):
    s = tiny(ROOT / ".cache" / "dips")
    ids = [c.id for c in s.clusters]
    world = World(s, tmp_path, "x")
    shared = World(s, tmp_path / "dp", "dp", replicas=False)
    for c, d in zip(world.clusters, shared.clusters):
        ref = build_trainer(c.spec.id, s.model, s.data, s.inner, s.seed, assignment=ids,
                            cache_dir=ROOT / ".cache" / "dips")
        assert c.sampler._seed == ref.batches._seed == sampler_seed(s.seed, c.spec.id)
        first = ref.batches.next_batch()
        assert torch.equal(c.sampler.next_batch(), first)
        assert torch.equal(d.sampler.next_batch(), first)
        assert all(torch.equal(a, b) for a, b in zip(c.trainer.params, ref.params))
        assert d.model is shared.clusters[0].model  # DP: one replicated model
    assert len({id(c.model) for c in world.clusters}) == len(ids)
