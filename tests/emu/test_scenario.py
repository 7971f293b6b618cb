"""Comparison scenarios (dips.spec.scenario) and the runner registry (dips.bench.runners)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from dips.bench import runners
from dips.spec.scenario import METHODS
from dips.spec import (PAPER_TRANSFER_OVER_ROUND, Scenario, SpecError, load_scenario,
                       paper_bytes_scale)

pytestmark = pytest.mark.timeout(30)
ROOT = Path(__file__).resolve().parents[2]
BASE = {"name": "t", "methods": ["di-ps"], "token_budget": 1000, "eval_every_tokens": 100,
        "eta": 100, "n_clusters": 4}


def _err(**changes) -> str:
    data = {**BASE, **changes}
    with pytest.raises(ValidationError) as info:
        Scenario.model_validate(data)
    return str(info.value)


def test_every_shipped_scenario_loads() -> None:
    files = sorted((ROOT / "configs" / "compare").glob("*.yaml"))
    names = {f.stem for f in files}
    assert {"eta10", "eta50", "eta100", "eta200", "slow-link", "weak-scaling", "tiny"} <= names
    for f in files:
        s = load_scenario(f)
        assert s.clusters and s.token_budget >= 1


def test_generator_spreads_slowdowns_and_links() -> None:
    s = Scenario.model_validate({**BASE, "link_pattern_bps": [1e10, 5e9, 1e9]})
    assert [c.slowdown for c in s.clusters] == pytest.approx([1.0, 4 / 3, 5 / 3, 2.0])
    assert [c.link.bps for c in s.clusters] == [1e10, 5e9, 1e9, 1e10]
    assert [c.id for c in s.clusters] == ["c0", "c1", "c2", "c3"]
    # A dumped scenario (generator fields and generated clusters) validates back to itself.
    assert Scenario.model_validate(s.model_dump()) == s


def test_errors_name_the_field() -> None:
    assert "typo_key" in _err(typo_key=1)
    assert "methods.0" in _err(methods=["sgd"])
    assert "methods" in _err(methods=["di-ps", "di-ps"])
    assert "n_clusters" in _err(n_clusters=None)
    assert "either clusters or eta" in _err(clusters=[{"id": "a"}])
    assert "token_budget" in _err(token_budget=None)
    data = {**BASE}
    del data["eta"], data["n_clusters"]
    bad = [{"id": "a", "slowdown": 0.5}]
    with pytest.raises(ValidationError, match=r"clusters\.0\.slowdown"):
        Scenario.model_validate({**data, "clusters": bad})
    with pytest.raises(ValidationError, match="end_s"):
        Scenario.model_validate({**data, "clusters": [
            {"id": "a", "transient": [{"start_s": 5, "end_s": 1, "factor": 2}]}]})
    with pytest.raises(ValidationError, match=r"clusters\.0\.link\.bps"):
        Scenario.model_validate({**data, "clusters": [{"id": "a", "link": {"bps": 0}}]})
    # A cluster without a link gets the 10 Gbit/s default; rates are bits/s.
    one = Scenario.model_validate({**data, "clusters": [{"id": "a"}]})
    assert one.clusters[0].link.bps == 1e10 and one.link_pattern_bps == [1e10]
    with pytest.raises(ValidationError, match="timing.step_s"):
        Scenario.model_validate({**BASE, "timing": {"step_s": -1}})
    with pytest.raises(ValidationError, match="weak_scaling.counts"):
        Scenario.model_validate({**BASE, "kind": "weak-scaling",
                                 "weak_scaling": {"counts": [1, 8], "tokens_per_cluster": 10}})


def test_load_scenario_refuses_a_non_mapping(tmp_path: Path) -> None:
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(SpecError, match=f"^{p}: expected a YAML mapping of Scenario fields"):
        load_scenario(p)


def test_paper_ratio_and_weak_scaling_prefix() -> None:
    # A 1.24e9-parameter model in BF16 at 10 Gbit: 1.984 s over a 100 s round.
    assert PAPER_TRANSFER_OVER_ROUND == pytest.approx(0.01984)
    scale = paper_bytes_scale(222016, 16, 1.5)
    s = Scenario.model_validate({**BASE, "inner": {"H": 16}, "timing": {"step_s": 1.5,
                                                                        "model_bytes_scale": scale}})
    assert s.transfer_over_round(222016) == pytest.approx(PAPER_TRANSFER_OVER_ROUND)
    ws = Scenario.model_validate({**BASE, "kind": "weak-scaling", "token_budget": None,
                                  "weak_scaling": {"counts": [1, 2, 4], "tokens_per_cluster": 10}})
    assert ws.token_budget == 40
    two = ws.with_clusters(2)
    assert [c.id for c in two.clusters] == ["c0", "c1"] and two.token_budget == 20
    assert two.kind == "compare" and two.eval_every_tokens == 200


def test_registry_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="mode"):
        runners.get_runner("warp", "di-ps")
    with pytest.raises(ValueError, match="method"):
        runners.get_runner("virtual", "sgd")
    assert callable(runners.get_runner("virtual", "di-ps"))
    # Every (mode, method) pair has a runner.
    assert set(runners.RUNNERS) == {(m, x) for m in runners.MODES for x in METHODS}
    # A mode whose runner module is not installed: a clear error, not an ImportError.
    monkeypatch.setitem(runners.RUNNERS, ("real", "dp"), ("dips.bench._no_such_module", "f", False))
    with pytest.raises(RuntimeError, match="not available"):
        runners.get_runner("real", "dp")
