"""One run, three kinds of cluster (issue 14): a leader, 2 followers, a 2-rank DDP cluster
under torchrun, a 2-rank pipeline cluster under torchrun and a one-process cluster, all
separate processes on 127.0.0.1 (gloo on CPU). The run reaches its outer steps with every
cluster accepted, each cluster's training loss falls, the run's invariants hold
(tests/integration/invariants.py), and each follower saw, per push of each cluster, exactly
one data connection per stage worker of that cluster with layers on that follower (its ranks
under torchrun, not ranks × connections)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.integration.invariants import check_run

from .roles import ROOT, follower_args, kill_left, stop_cleanly
from .roles import dips as _dips
from .test_pipeline_cluster import expected_connections
from .torchrun import decisions, lines, torchrun, wait

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

CLUSTERS = [{"id": "d", "parallel": "ddp"}, {"id": "p", "parallel": "pipeline"},
            {"id": "s", "stages": 1}]


def _run_view(tmp: Path) -> Path:
    """The role processes' state directories laid out as a `dips launch` run directory (what
    check_run reads); ``summary.json`` holds the leader's final version."""
    run = tmp / "run"
    (run / "followers").mkdir(parents=True)
    for i in range(2):
        (run / "followers" / str(i)).symlink_to(tmp / f"f{i}")
    for name in ("outer_steps.jsonl", "leader.json"):
        (run / name).symlink_to(tmp / "leader" / name)
    state = json.loads((tmp / "leader" / "leader.json").read_text())
    (run / "summary.json").write_text(json.dumps({"final_version": state["version"]}))
    return run


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_ddp_pipeline_and_one_process_clusters_train_one_model(tmp_path):
    from dips.emu.launcher import free_port

    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg.update(clusters=CLUSTERS, max_time_s=None, max_outer_steps=5)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    leader = f"127.0.0.1:{free_port()}"
    procs = {"leader": _dips(["leader", "--config", str(tmp_path / "run.yaml"), "--listen",
                              leader, "--state-dir", str(tmp_path / "leader"), "--insecure"],
                             tmp_path / "leader.log")}
    try:
        for c in ("d", "p"):
            procs[c] = torchrun(c, leader, tmp_path / c, tmp_path / f"{c}.log")
        procs["s"] = _dips(["cluster", "--leader", leader, "--cluster-id", "s", "--state-dir",
                            str(tmp_path / "s"), "--insecure"], tmp_path / "s.log")
        # Every cluster waits for the followers (NOT_READY) before any joins: they start
        # training together, so that each gets into the run's few outer steps.
        for c in ("d", "p", "s"):
            wait(f"cluster {c} waiting for the followers", lambda c=c: "join not possible yet"
                 in (tmp_path / f"{c}.log").read_text(), procs)
        for i in range(2):
            procs[f"f{i}"] = _dips(follower_args(leader, i, tmp_path / f"f{i}"),
                                   tmp_path / f"f{i}.log")
        for c in ("d", "p", "s"):
            assert procs[c].wait(300) == 0, (tmp_path / f"{c}.log").read_text()[-3000:]
        decided = decisions(tmp_path / "leader")
        assert len(decided) >= 5
        assert {c for d in decided.values() for c in d["accepted"]} == {"d", "p", "s"}
        stop_cleanly(procs, ("f0", "f1", "leader"))

        check_run(_run_view(tmp_path), followers=2, seq_len=64, evaluated=False)
        stages = {}
        for c in ("d", "p", "s"):
            recs = lines(tmp_path / c / "train.jsonl")
            stages[c] = next(r["stages"] for r in recs if r.get("event") == "join")
            losses = [r["loss"] for r in recs if "step" in r]
            assert len(losses) >= 16 and _mean(losses[-4:]) < _mean(losses[:4]) - 0.2, (c, losses)
        assert len(stages["d"]) == len(stages["p"]) == 2 and len(stages["s"]) == 1
        assert stages["p"] == [["embed", "layers.0"], ["layers.1", "head"]]
        for f in range(2):
            applied = [r for r in lines(tmp_path / f"f{f}" / "applied.jsonl") if "accepted" in r]
            assert len(applied) == len(decided)
            for r in applied:
                want = {c: expected_connections(tmp_path / "leader" / "run.json",
                                                stages[c])[f] for c in r["accepted"]}
                assert r["connections"] == want, (f, r)
                # Review of issue 15, #10: busy time by phase since the previous record
                # (its pushes were received and its update made within the span)
                assert r["busy_s"]["update"] > 0 and r["busy_s"]["push"] > 0, r
                assert 0 < sum(r["busy_s"].values()) <= 3 * r["span_s"]
    finally:
        kill_left(procs)
