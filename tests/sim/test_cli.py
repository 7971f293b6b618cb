"""``dips simulate --scenario FILE --out DIR``: simulate.json and plots; bad input named."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from dips.cli import app
from tests.sim.helpers import small

pytestmark = pytest.mark.timeout(60)


def test_simulate_writes_json_and_plots(tmp_path):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump(small(horizon_s=600).model_dump(mode="json")))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["simulate", "--scenario", str(scenario), "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "simulate.json").read_text())
    assert doc["plots"] == ["timeline.png", "followers.png"]
    assert all((out / p).stat().st_size > 10_000 for p in doc["plots"])
    assert doc["rounds"]["outer_steps"] > 0 and "outer steps" in result.output


def test_simulate_names_a_bad_field(tmp_path):
    data = small().model_dump(mode="json")
    data["followers"]["nic_bps"] = "fast"
    scenario = tmp_path / "bad.yaml"
    scenario.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["simulate", "--scenario", str(scenario),
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "followers.nic_bps = 'fast'" in result.output
    assert not (tmp_path / "out").exists()


def test_clusters_that_never_pushed_are_named_not_hidden_by_the_maximum(tmp_path):
    """Review 27: clusters down all run long showed 0.0 added time, and the summary's maximum
    (another cluster's) read as a healthy run."""
    data = small(horizon_s=600).model_dump(mode="json")
    data["clusters"][2]["join_s"] = 10_000  # c joins after the horizon: it never pushes
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["simulate", "--scenario", str(scenario), "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "simulate.json").read_text())
    assert doc["overhead"]["clusters_without_push"] == ["c"]
    assert "1 of 4 clusters never pushed" in result.output and ": c" in result.output


def test_a_horizon_before_any_push_is_summarised_not_a_traceback(tmp_path):
    """Review 29 (finding 1): a horizon shorter than the first pull left every figure null,
    and the summary line raised TypeError."""
    data = small(horizon_s=600).model_dump(mode="json")
    for c in data["clusters"]:
        c["join_s"] = 10_000  # nobody joins within the horizon
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["simulate", "--scenario", str(scenario), "--out", str(out),
                                      "--no-plots"])
    assert result.exit_code == 0, result.output
    assert "added time per cluster: max n/a (no push)" in result.output
    assert "no outer step kept" in result.output and "staleness mean n/a" in result.output
    assert "NOT ANSWERED: the horizon (600 s) holds no outer step" in result.output


def _run(tmp_path, data):
    """``dips simulate --no-plots`` on the scenario ``data``: (CLI result, simulate.json)."""
    scenario, out = tmp_path / "s.yaml", tmp_path / "out"
    scenario.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["simulate", "--scenario", str(scenario), "--out", str(out),
                                      "--no-plots"])
    assert result.exit_code == 0, result.output
    return result, json.loads((out / "simulate.json").read_text())


def test_a_horizon_too_short_for_every_cluster_to_sync_says_so(tmp_path):
    """Review of issue 16: a horizon holding a few outer steps gave figures as if answered.
    Here c joins late and completes no sync: the run's figures are of the start only."""
    data = small(horizon_s=600).model_dump(mode="json")
    data["clusters"][2]["join_s"] = 590  # c joins, pulls, and the horizon ends while it trains
    result, doc = _run(tmp_path, data)
    h = doc["horizon"]
    assert h["outer_steps"] > 0 and h["clusters_without_sync"] == ["c"] and not h["answers"]
    assert "NOT ANSWERED: the horizon (600 s) is too short to answer: 1 of 4 clusters " \
           "completed no sync" in result.output
    data["clusters"][2]["join_s"] = 30
    result, doc = _run(tmp_path, data)
    assert "NOT ANSWERED" not in result.output and doc["horizon"]["answers"]
