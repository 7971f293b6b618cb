"""Model builders and the per-layer table (dips.train.model)."""

from __future__ import annotations

import pytest
import torch

from dips.spec import ModelConfig
from dips.train.model import build_model, layer_of, layer_table, param_count


def _same(m1, m2) -> bool:
    s1, s2 = m1.state_dict(), m2.state_dict()
    return s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)


def test_same_seed_same_weights_and_rng_untouched(tiny_cfg):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b, c = build_model(tiny_cfg, 0), build_model(tiny_cfg, 0), build_model(tiny_cfg, 1)
    assert torch.equal(before, torch.get_rng_state())
    assert _same(a, b)
    assert not _same(a, c)
    assert all(p.dtype == torch.float32 for p in a.parameters())
    assert a.training


def test_default_config_size():
    model = build_model(ModelConfig(), seed=0)
    assert param_count(model) == 1_250_432
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_qwen3_builds_and_runs(tiny_cfg):
    model = build_model(tiny_cfg.model_copy(update={"arch": "qwen3"}), seed=0)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    names = [n for n, _ in model.named_parameters()]
    assert "model.layers.0.self_attn.q_norm.weight" in names
    logits = model(input_ids=torch.zeros(2, 8, dtype=torch.long)).logits
    assert logits.shape == (2, 8, 512)


@pytest.mark.parametrize("tie", [True, False])
def test_layer_table_covers_each_param_once(tiny_cfg, tie):
    model = build_model(tiny_cfg.model_copy(update={"tie_embeddings": tie}), seed=0)
    table = layer_table(model)
    assert [key for key, _, _ in table] == ["embed", "layers.0", "layers.1", "head"]
    listed = [n for _, names, _ in table for n in names]
    assert listed == [n for n, _ in model.named_parameters()]
    assert len(listed) == len(set(listed))
    params = dict(model.named_parameters())
    for key, names, nbytes in table:
        assert nbytes == 4 * sum(params[n].numel() for n in names)
        assert all(layer_of(n) == key for n in names)
    assert sum(nbytes for _, _, nbytes in table) == 4 * param_count(model)
    head = dict((k, n) for k, n, _ in table)["head"]
    assert ("lm_head.weight" in head) is (not tie)


def test_layer_of_mapping_and_errors():
    assert layer_of("model.embed_tokens.weight") == "embed"
    assert layer_of("model.layers.11.mlp.up_proj.weight") == "layers.11"
    assert layer_of("model.norm.weight") == "head"
    assert layer_of("lm_head.weight") == "head"
    with pytest.raises(ValueError, match="model.rotary_emb.inv_freq"):
        layer_of("model.rotary_emb.inv_freq")


def test_config_validation():
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig(hidden_size=-1)
    with pytest.raises(ValueError, match="bogus"):
        ModelConfig(bogus=1)
    with pytest.raises(ValueError, match="arch"):
        ModelConfig(arch="gpt2")
    assert ModelConfig(hidden_size=30, num_heads=3, num_kv_heads=1).resolved_head_dim == 10
