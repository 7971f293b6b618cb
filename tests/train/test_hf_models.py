"""Bring your own architecture (issue 14): any ``AutoModelForCausalLM`` from an HF config,
its decoder blocks found in the module tree, trained by Di-PS like the built-in LLaMA."""

from __future__ import annotations

import pytest
import torch

from dips.emu.virtual import run_dips
from dips.roles.layers import blocks_prefix, group_layers
from dips.spec import ModelConfig
from dips.train.model import build_model, check_built, layer_namer, layer_of, layer_table
from tests.emu.vt_helpers import ROOT, tiny

pytestmark = pytest.mark.timeout(120)

ARCHS = {
    "llama": ({"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
               "max_position_embeddings": 64}, "model.layers"),
    "gpt2": ({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
             "transformer.h"),
    "gpt_neox": ({"model_type": "gpt_neox", "hidden_size": 32, "num_hidden_layers": 3,
                  "num_attention_heads": 4, "intermediate_size": 64,
                  "max_position_embeddings": 64}, "gpt_neox.layers"),
    "qwen3": ({"model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
               "intermediate_size": 64, "max_position_embeddings": 64}, "model.layers"),
}


def hf(kind: str, **over) -> ModelConfig:
    return ModelConfig(arch="hf", hf_config=ARCHS[kind][0], vocab_size=512, **over)


@pytest.mark.parametrize("kind", sorted(ARCHS))
def test_an_hf_config_builds_a_model_whose_blocks_are_its_layers(kind):
    model = build_model(hf(kind), seed=3)
    assert blocks_prefix(model) == ARCHS[kind][1]
    table = layer_table(model)
    blocks = ARCHS[kind][0].get("n_layer") or ARCHS[kind][0]["num_hidden_layers"]
    assert [k for k, _, _ in table] == ["embed", *(f"layers.{i}" for i in range(blocks)), "head"]
    names = [n for n, _ in model.named_parameters()]
    assert sorted(n for _, ns, _ in table for n in ns) == sorted(names)  # each param once
    assert sum(b for _, _, b in table) == 4 * sum(p.numel() for p in model.parameters())
    assert [k for k, _ in group_layers(model)] == [k for k, _, _ in table]  # contiguous
    assert model.get_input_embeddings().weight.shape[0] == 512  # the run's vocabulary
    logits = model(input_ids=torch.randint(0, 512, (2, 16)), use_cache=False).logits
    assert logits.shape == (2, 16, 512)
    again = build_model(hf(kind), seed=3)  # every process builds bit-identical weights
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_the_built_in_models_are_named_as_before():
    for arch in ("llama", "qwen3"):
        model = build_model(ModelConfig(arch=arch), seed=0)
        named = layer_namer(model)
        assert all(named(n) == layer_of(n) for n, _ in model.named_parameters())


def test_a_layer_pattern_overrides_the_search_and_bad_ones_are_named():
    model = build_model(hf("gpt2"), seed=0)
    by_pattern = layer_namer(model, r"^transformer\.h\.(\d+)\.")
    found = layer_namer(model)
    assert all(by_pattern(n) == found(n) for n, _ in model.named_parameters())
    with pytest.raises(ValueError, match="matches no parameter") as bad:
        layer_namer(model, r"^model\.layers\.(\d+)\.")
    assert r"'^model\.layers\.(\d+)\.'" in str(bad.value)  # as written, not its repr
    with pytest.raises(ValueError, match="no group"):
        layer_namer(model, r"^transformer\.h\.")
    with pytest.raises(ValueError, match="not a parameter"):
        found("transformer.h.9.attn.c_attn.weight")
    with pytest.raises(ValueError, match="layer_pattern"):
        hf("gpt2", layer_pattern="(unclosed")
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig(arch="hf", hf_config={"n_embd": 32})
    with pytest.raises(ValueError, match="arch hf"):
        ModelConfig(arch="llama", hf_config=ARCHS["gpt2"][0])
    with pytest.raises(ValueError, match="hf_config"):
        build_model(ModelConfig(arch="hf", hf_config={"model_type": "no-such-model"}), seed=0)


def test_the_built_model_is_checked_against_the_run():
    model = build_model(hf("gpt2"), seed=0)
    assert len(check_built(model, seq_len=64, followers=4)) == 4
    with pytest.raises(ValueError, match="max_position_embeddings = 64"):
        check_built(model, seq_len=65, followers=1)
    with pytest.raises(ValueError, match="followers = 5 exceeds the 4 layers"):
        check_built(model, seq_len=32, followers=5)


def test_di_ps_trains_a_gpt2_in_virtual_time(tmp_path):
    """The whole method on another architecture: three clusters, two followers, the tiny
    comparison's budget; the held-out loss falls as it does for the built-in LLaMA."""
    s = tiny(ROOT / ".cache" / "dips", model={"arch": "hf", "hf_config": ARCHS["gpt2"][0]},
             token_budget=9216)
    r = run_dips(s, tmp_path)
    assert r.updates_accepted > 0 and r.tokens_accepted >= s.token_budget
    assert r.final_eval_loss < r.curve[0].eval_loss - 0.3


class TwoLists(torch.nn.Module):
    """Blocks in two lists (review 24, F7): ``a`` (3 blocks) is found, ``b`` (2) is not."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.a = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        self.mid = torch.nn.LayerNorm(4)
        self.b = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.out = torch.nn.Linear(4, 8)


def test_blocks_in_a_second_list_are_named_in_a_warning_and_a_pattern_may_not_merge_them(caplog):
    model = TwoLists()
    with caplog.at_level("WARNING", logger="dips.roles.layers"):
        named = layer_namer(model)
    assert named("a.2.weight") == "layers.2" and named("b.0.weight") == "head"
    assert "ModuleList 'b' (2 modules" in caplog.text and "layer_pattern" in caplog.text
    with pytest.raises(ValueError, match=r"index 0 to two blocks, 'a\.0' and 'b\.0'"):
        layer_namer(model, r"^(?:a|b)\.(\d+)\.")
    caplog.clear()
    with caplog.at_level("WARNING", logger="dips.roles.layers"):
        layer_namer(build_model(ModelConfig(arch="llama"), seed=0))
    assert caplog.text == ""  # one list of blocks: nothing to say
