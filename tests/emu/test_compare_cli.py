"""`dips bench compare` on the tiny scenario writes compare.json, compare.md and the PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dips.cli import app
from tests.emu.vt_helpers import ROOT, TINY

pytestmark = pytest.mark.timeout(180)
PNG = b"\x89PNG\r\n\x1a\n"


def _scenario(tmp_path: Path, **over) -> Path:
    data = yaml.safe_load(TINY.read_text())
    data["data"]["cache_dir"] = str(ROOT / ".cache" / "dips")
    data.update(over)
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_compare_writes_report_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["bench", "compare", "--scenario", str(_scenario(tmp_path)),
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "compare.json").read_text())
    methods = [r["method"] for r in doc["results"]]
    assert methods == ["dp", "diloco", "async-diloco", "di-ps"]
    assert doc["shaping"] == ["virtual"] and doc["derived"]["diloco"]["speedup_vs_diloco"] == 1.0
    for r in doc["results"]:
        assert r["tokens"] >= doc["config"]["token_budget"] and r["curve"]
        assert r["final_eval_loss"] < r["curve"][0]["eval_loss"]
    md = (out / "compare.md").read_text()
    for m in methods:
        assert f"| {m} |" in md
    assert "speedup vs DiLoCo" in md and "virtual time" in md
    for png in ("loss_vs_tokens.png", "loss_vs_time.png", "throughput.png"):
        assert (out / png).read_bytes()[:8] == PNG and png in md
    assert (out / "methods" / "di-ps" / "events.jsonl").stat().st_size > 0


def test_weak_scaling_kind_writes_points_and_plots(tmp_path: Path) -> None:
    path = _scenario(tmp_path, kind="weak-scaling", methods=["di-ps", "diloco"],
                     token_budget=None, weak_scaling={"counts": [1, 3], "tokens_per_cluster": 2048})
    out = tmp_path / "ws"
    res = CliRunner().invoke(app, ["bench", "compare", "--scenario", str(path), "--out", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "compare.json").read_text())
    assert {(p["clusters"], p["method"]) for p in doc["points"]} == {
        (1, "di-ps"), (1, "diloco"), (3, "di-ps"), (3, "diloco")}
    for p in doc["points"]:
        # Nobody beats independent clusters without communication.
        assert 0 < p["frac_of_ideal"] <= 1.0
    for png in ("weak_scaling.png", "weak_scaling_efficiency.png"):
        assert (out / png).read_bytes()[:8] == PNG


def test_invalid_scenario_names_the_field(tmp_path: Path) -> None:
    path = _scenario(tmp_path, methods=["di-ps", "sgd"])
    res = CliRunner().invoke(app, ["bench", "compare", "--scenario", str(path),
                                   "--out", str(tmp_path / "x")])
    assert res.exit_code == 2
    assert "methods.1" in res.output and not (tmp_path / "x").exists()
