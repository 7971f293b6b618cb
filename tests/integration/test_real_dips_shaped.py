"""`dips bench compare` in real time runs Di-PS with the baselines' shaping: as root, clusters in
network namespaces behind tc tbf, else the clusters' token buckets; a bandwidth schedule
changes the live link's rate, the report says which shaping ran, and the global model's loss
falls (issue 3).  The tc-tbf case needs root and network namespaces (skipped otherwise, with
the reason); the run creates and removes its own namespaces.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from dips.bench.compare import run_compare
from dips.bench.scenario import Scenario
from dips.emu import netns

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

_CAP = netns.probe()


@pytest.mark.parametrize("shaping", [
    pytest.param("tc-tbf", marks=pytest.mark.skipif(
        _CAP.shaping != "tc-tbf", reason=f"kernel shaping unavailable: {_CAP.reason}")),
    "token-bucket"])
def test_real_time_dips_is_shaped_and_follows_the_bandwidth_schedule(shaping, tmp_path):
    data = yaml.safe_load((ROOT / "configs/compare/tiny.yaml").read_text())
    generated = Scenario.model_validate(data).clusters
    data.update(eta=None, n_clusters=None, mode="real", methods=["di-ps"],
                real={"shaping": shaping, "time_scale": 0.05, "max_time_s": 120},
                clusters=[c.model_dump() for c in generated])
    data["data"]["cache_dir"] = str(ROOT / ".cache" / "dips")
    # c2's link drops from 10 to 0.5 Gbit at emulated 20 s (1 s after the launcher's training
    # start, so before the clusters have joined: the pushes all run at the lower rate).
    data["clusters"][2]["bandwidth_schedule"] = [{"at_s": 20.0, "gbit": 0.5}]
    doc = run_compare(Scenario.model_validate(data), tmp_path / "out")
    (res,) = doc["results"]
    assert res["method"] == "di-ps" and res["shaping"] == shaping and doc["shaping"] == [shaping]
    assert res["extra"]["network"] == ("netns" if shaping == "tc-tbf" else "loopback")
    assert res["final_eval_loss"] < res["curve"][0]["eval_loss"] - 0.05, res["curve"]
    assert res["tokens"] >= data["token_budget"] and res["updates_accepted"] > 0
    (change,) = res["extra"]["link_changes"]
    assert change["process"] == "cluster-c2" and change["how"] == shaping
    assert change["at_s"] == pytest.approx(1.0)
    assert change["link_bps"] == pytest.approx(res["extra"]["link_bps"]["c2"] / 20)
    assert ("kernel shaping" if shaping == "tc-tbf" else "token bucket") in (
        tmp_path / "out" / "compare.md").read_text()
    # The real transfers felt it: c2's pushes (now over 1/20 of c0's rate) take longer.
    run_dir = tmp_path / "out" / "methods" / "di-ps"

    def mean_push_s(cid: str) -> float:
        lines = (run_dir / "clusters" / cid / "train.jsonl").read_text().splitlines()
        push = [json.loads(line)["push"]["push_s"] for line in lines if '"push"' in line]
        return sum(push) / len(push)

    assert mean_push_s("c2") > 2 * mean_push_s("c0")
    # The run removed its namespaces and every process it started is gone.
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    if shaping == "tc-tbf":
        prefix = next(e["prefix"] for e in events if e["event"] == "network")
        assert netns.list_namespaces(prefix) == []
    for e in events:
        if e["event"] in ("start", "restart"):
            with pytest.raises(ProcessLookupError):
                os.kill(e["pid"], 0)
