"""A cluster as a torchrun job of two pipeline stages (issue 14, ``parallel: pipeline``)
against a real leader and two real followers (separate processes, gloo on CPU, 127.0.0.1):
stage 0 (embedding, first block) and stage 1 (last block, final norm; the head is tied to the
embedding) each push exactly their own layers, every outer step is accepted, after every pull
both ranks hold the global model the followers hold (FP32 wire: the replicas' per-shard
checksums equal the followers'), T_j is every microbatch's tokens of the interval, and each
follower saw one data connection per stage worker with layers on it, per push."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from .roles import ROOT, kill_left, start_roles, stop_cleanly
from .torchrun import decisions, lines, torchrun

# make test-long: test_mixed_clusters.py runs a pipeline cluster in make test.
pytestmark = [pytest.mark.integration, pytest.mark.long, pytest.mark.timeout(300)]


def expected_connections(run_json: Path, stages: list[list[str]]) -> dict[int, int]:
    """Follower index -> stage workers of a cluster with ``stages`` that own a layer on it."""
    owned = json.loads(run_json.read_text())["follower_layers"]
    return {f: sum(1 for s in stages if set(s) & set(layers)) for f, layers in enumerate(owned)}


def test_two_pipeline_stages_push_their_own_layers_and_hold_the_pulled_model(tmp_path):

    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg.update(clusters=[{"id": "p", "parallel": "pipeline", "microbatches": 2}],
               max_time_s=None, max_outer_steps=3, outer={"wire_dtype": "fp32"})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    leader, procs = start_roles(tmp_path, tmp_path / "run.yaml", 2)
    procs["p"] = torchrun("p", leader, tmp_path / "p", tmp_path / "p.log")
    try:
        assert procs["p"].wait(240) == 0, (tmp_path / "p.log").read_text()[-3000:]
        decided = decisions(tmp_path / "leader")
        assert len(decided) >= 3 and all(d["accepted"] == ["p"] for d in decided.values())
        recs = lines(tmp_path / "p" / "train.jsonl")
        join, pushes = recs[0], [r["push"] for r in recs if "push" in r]
        assert join["ranks"] == 2
        assert join["stages"] == [["embed", "layers.0"], ["layers.1", "head"]]
        accepted = [p for p in pushes if p["accepted"]]
        assert len(accepted) >= 3
        for p in accepted:
            assert [r["layers"] for r in p["ranks"]] == [sorted(s) for s in join["stages"]]
            assert all(r["bytes"] > 0 and r["error"] is None for r in p["ranks"])
            assert p["replicas"]["version"] == p["version"]
            assert p["replicas"]["checksums"] == decided[p["version"]]["checksums"]
            assert p["tokens"] == decided[p["version"]]["tokens"]["p"] == 8 * 4 * 64
        steps = [r for r in recs if "step" in r]
        assert all(b["tokens"] - a["tokens"] == 4 * 64 for a, b in zip(steps, steps[1:]))
        want = expected_connections(tmp_path / "leader" / "run.json", join["stages"])
        for f in range(2):
            applied = [r for r in lines(tmp_path / f"f{f}" / "applied.jsonl") if "accepted" in r]
            assert len(applied) >= 3
            assert all(r["connections"] == {"p": want[f]} for r in applied), (f, applied)
        log = (tmp_path / "p.log").read_text()
        assert "rank 1 of 2" in log and "the run finished (max outer steps)" in log
        stop_cleanly(procs, ("f0", "f1", "leader"))
    finally:
        kill_left(procs)


def test_killing_a_stage_rank_ends_that_cluster_alone_and_it_rejoins(tmp_path):
    import os
    import re
    import signal

    from .torchrun import wait

    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg.update(clusters=[{"id": "p", "parallel": "pipeline"}], max_time_s=None, followers=1)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    leader, procs = start_roles(tmp_path, tmp_path / "run.yaml", 1)
    log = tmp_path / "p.log"
    procs["p"] = torchrun("p", leader, tmp_path / "p", log)
    try:
        wait("a first outer step", lambda: decisions(tmp_path / "leader"), procs)
        pid = int(re.search(r"rank 1 of 2 \(local rank 1, pid (\d+)\)", log.read_text())[1])
        os.kill(pid, signal.SIGKILL)
        assert procs.pop("p").wait(60) != 0  # the cluster fails as a whole ...
        assert all(p.poll() is None for p in procs.values())  # ... the leader, follower serve
        before = max(decisions(tmp_path / "leader"))
        procs["p"] = torchrun("p", leader, tmp_path / "p", log)  # the operator restarts it

        def rejoined_and_accepted() -> bool:
            recs = lines(tmp_path / "p" / "train.jsonl")
            joins = [i for i, r in enumerate(recs) if r.get("event") == "join"]
            return len(joins) == 2 and any(r.get("push", {}).get("accepted")
                                           for r in recs[joins[1]:])
        wait("the restarted cluster's accepted push", rejoined_and_accepted, procs)
        assert max(decisions(tmp_path / "leader")) > before
        procs["p"].send_signal(signal.SIGTERM)
        procs.pop("p").wait(60)
        stop_cleanly(procs, ("f0", "leader"))
    finally:
        kill_left(procs)
