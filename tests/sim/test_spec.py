"""Scenario files of ``dips simulate`` (dips.spec.simulate): strict, errors name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from dips.sim.costs import layer_params
from dips.spec import SpecError, validate
from dips.spec.simulate import SimScenario, load_sim_scenario
from dips.spec.training import ModelConfig
from tests.sim.helpers import small

pytestmark = pytest.mark.timeout(30)
ROOT = Path(__file__).resolve().parents[2]


def test_cluster_types_expand_to_ids():
    s = small()
    assert [i for c in s.clusters for i in c.ids()] == ["a1", "a2", "b", "c"]


@pytest.mark.parametrize("patch, field", [
    ({"followers": {"nic_bps": -1}}, "followers.nic_bps"),
    ({"horizon_s": 0}, "horizon_s"),
    ({"followers": {"typo": 1}}, "followers.typo"),
    ({"norms": {"anomaly_prob": 2}}, "norms.anomaly_prob"),
])
def test_bad_input_names_the_field(patch, field):
    doc = small().model_dump(mode="json")
    for k, v in patch.items():
        doc[k] = {**doc[k], **v} if isinstance(v, dict) else v
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        validate(SimScenario, doc, "scenario.yaml")


def test_cross_field_checks():
    doc = small().model_dump(mode="json")
    doc["clusters"].append({**doc["clusters"][0], "count": 1, "id": "a1"})
    with pytest.raises(SpecError, match="must be unique"):
        validate(SimScenario, doc)
    doc = small().model_dump(mode="json")
    doc["followers"]["count"] = 7  # the default model has 4 + 2 layers
    with pytest.raises(SpecError, match="followers.count = 7 exceeds the 6 layers"):
        validate(SimScenario, doc)


def test_layer_params_match_the_models_dips_builds():
    # ModelConfig's docstring: the defaults give 1,250,432 (llama) / 1,250,688 (qwen3).
    assert sum(p for _, p in layer_params(ModelConfig())) == 1_250_432
    assert sum(p for _, p in layer_params(ModelConfig(arch="qwen3"))) == 1_250_688
    names = [n for n, _ in layer_params(ModelConfig())]
    assert names == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]


def test_the_production_scenario_loads():
    s = load_sim_scenario(ROOT / "configs" / "simulate" / "production-100b.yaml")
    assert sum(p for _, p in layer_params(s.model)) == 102_543_925_248
    assert len([i for c in s.clusters for i in c.ids()]) == 9
    assert s.followers.count == 16 and s.followers.nic_bps == 25e9
