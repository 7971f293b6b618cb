"""A cluster as a torchrun job of two ranks (issue 14), DDP replicas or FSDP2 shards, against a
real leader and real followers (separate processes, gloo on CPU, 127.0.0.1): both ranks push
their own blocks, every outer step is accepted, and after every pull both ranks hold exactly
the global model the followers hold (FP32 on the wire, so the per-shard checksums of the
replicas, or of the FSDP2 model gathered whole, equal the followers'). Killing one rank ends
that cluster alone; restarted, it re-joins and trains on."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dips.emu.launcher import free_port

from .roles import ROOT, kill_left, start_roles, stop_cleanly

pytestmark = pytest.mark.timeout(300)


def _config(tmp: Path, **extra) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg.update(clusters=[{"id": "d"}], max_time_s=None, outer={"wire_dtype": "fp32"}, **extra)
    (tmp / "run.yaml").write_text(yaml.safe_dump(cfg))
    return tmp / "run.yaml"


def _torchrun(leader: str, state: Path, log: Path, restarts: int = 0) -> subprocess.Popen:
    """The cluster ``d`` as ``torchrun --nproc-per-node 2 -m dips.cluster`` (own session)."""
    with open(log, "a") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
             "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
             str(free_port()), "--max-restarts", str(restarts), "-m", "dips.cluster",
             "--leader", leader, "--cluster-id", "d", "--state-dir", str(state), "--insecure"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))


def _lines(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] \
        if path.exists() else []


def _decisions(tmp: Path) -> dict[int, dict]:
    return {d["version"]: d for d in _lines(tmp / "leader" / "outer_steps.jsonl")
            if "accepted" in d}


def _wait(what: str, cond, procs: dict, limit_s: float = 200.0) -> None:
    """Poll ``cond()`` until true (an event in a file, not a duration); fail early if a
    process of ``procs`` exited."""
    deadline = time.monotonic() + limit_s
    while not cond():
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        assert not dead and time.monotonic() < deadline, f"waiting for {what}: exited {dead}"
        time.sleep(0.2)


@pytest.mark.parametrize("parallel", [
    pytest.param("ddp", marks=pytest.mark.long),  # make test-long; DDP: test_mixed_clusters.py
    "fsdp2"])
def test_two_ranks_push_their_blocks_and_both_replicas_hold_the_pulled_model(tmp_path, parallel):
    cfg = _config(tmp_path, max_outer_steps=3)
    doc = yaml.safe_load(cfg.read_text())
    doc["clusters"] = [{"id": "d", "parallel": parallel}]
    cfg.write_text(yaml.safe_dump(doc))
    leader, procs = start_roles(tmp_path, cfg, followers=2)
    procs["d"] = _torchrun(leader, tmp_path / "d", tmp_path / "d.log")
    try:
        assert procs["d"].wait(240) == 0, (tmp_path / "d.log").read_text()[-3000:]
        decisions = _decisions(tmp_path)
        assert len(decisions) >= 3 and all(d["accepted"] == ["d"] for d in decisions.values())
        recs = _lines(tmp_path / "d" / "train.jsonl")
        join, pushes = recs[0], [r["push"] for r in recs if "push" in r]
        layers = [l for s in join["stages"] for l in s]
        assert join["ranks"] == 2 and len(join["stages"]) == 2 and len(set(layers)) == len(layers)
        accepted = [p for p in pushes if p["accepted"]]
        assert len(accepted) >= 3
        for p in accepted:
            assert [r["rank"] for r in p["ranks"]] == [0, 1]
            assert [sorted(r["layers"]) for r in p["ranks"]] == [sorted(s) for s in join["stages"]]
            assert all(r["bytes"] > 0 and r["error"] is None for r in p["ranks"])
            # Both replicas (compared by the ranks) equal the followers' shards of the version.
            assert p["replicas"]["version"] == p["version"]
            assert p["replicas"]["checksums"] == decisions[p["version"]]["checksums"]
            assert p["tokens"] == decisions[p["version"]]["tokens"]["d"]
        steps = [r for r in recs if "step" in r]
        per_step = 4 * 64  # batch_size × seq_len of tiny.yaml, split between the 2 ranks
        assert all(b["tokens"] - a["tokens"] == per_step for a, b in zip(steps, steps[1:]))
        log = (tmp_path / "d.log").read_text()
        assert "rank 1 of 2" in log and "the run finished (max outer steps)" in log
        stop_cleanly(procs, ("f0", "f1", "leader"))
    finally:
        kill_left(procs)


def test_killing_one_rank_ends_that_cluster_alone_and_it_rejoins(tmp_path):
    leader, procs = start_roles(tmp_path, _config(tmp_path, followers=1), followers=1)
    log = tmp_path / "d.log"
    procs["d"] = _torchrun(leader, tmp_path / "d", log)
    try:
        _wait("a first outer step", lambda: _decisions(tmp_path), procs)
        pid = int(re.search(r"rank 1 of 2 \(local rank 1, pid (\d+)\)", log.read_text())[1])
        os.kill(pid, signal.SIGKILL)
        assert procs.pop("d").wait(60) != 0  # the cluster fails as a whole ...
        assert all(p.poll() is None for p in procs.values())  # ... the leader, follower serve
        before = max(_decisions(tmp_path))
        procs["d"] = _torchrun(leader, tmp_path / "d", log)  # the operator restarts it

        def rejoined_and_accepted() -> bool:
            recs = _lines(tmp_path / "d" / "train.jsonl")
            joins = [i for i, r in enumerate(recs) if r.get("event") == "join"]
            return len(joins) == 2 and any(r.get("push", {}).get("accepted")
                                           for r in recs[joins[1]:])
        _wait("the restarted cluster's accepted push", rejoined_and_accepted, procs)
        assert max(_decisions(tmp_path)) > before
        procs["d"].send_signal(signal.SIGTERM)
        procs.pop("d").wait(60)
        stop_cleanly(procs, ("f0", "leader"))
    finally:
        kill_left(procs)
