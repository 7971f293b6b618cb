"""Smoke tests on CUDA (issue 14), skipped where ``torch.cuda.is_available()`` is false: a
real run (leader, follower, cluster as processes on 127.0.0.1) whose cluster trains on the
GPU — a 2-rank torchrun cluster (one GPU per rank, NCCL for gradients and parameters, gloo
for control), or a one-process cluster — commits rounds, pushes through pinned host buffers,
pulls back onto the device and saves its inner AdamW state."""

from __future__ import annotations

import pytest
import torch

from dips.roles.cluster_state import read_saved

from .inner_run import cluster, config, kill_all, lines, pointer, roles, wait

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _accepted(state, n: int):
    def cond() -> object:
        pushes = [r["push"] for r in lines(state / "train.jsonl") if "push" in r]
        ok = [p for p in pushes if p["accepted"] and p["ok"]]
        return len(ok) >= n and pointer(state) and ok
    return cond


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one per rank)")
def test_a_two_rank_torchrun_cluster_trains_on_the_gpus(tmp_path, parallel):
    leader, procs = roles(tmp_path, config(tmp_path, {"id": "g", "parallel": parallel,
                                                      "device": "cuda"}))
    state, log = tmp_path / "g", tmp_path / "g.log"
    try:
        procs["g"] = cluster(leader, "g", state, log, ranks=2)
        pushes = wait("two accepted pushes", _accepted(state, 2), procs, 240)
        text = log.read_text()
        assert "rank 0 of 2 (local rank 0" in text and "on cuda:0" in text
        assert "rank 1 of 2 (local rank 1" in text and "on cuda:1" in text
        assert all([r["rank"] for r in p["ranks"]] == [0, 1] for p in pushes)
        meta, saved = read_saved(state / "inner")
        assert meta["mode"] == parallel and meta["step"] >= 8 and saved
    finally:
        kill_all(procs)


def test_a_one_process_cluster_trains_on_the_gpu(tmp_path):
    leader, procs = roles(tmp_path, config(tmp_path, {"id": "g", "device": "cuda"}))
    state, log = tmp_path / "g", tmp_path / "g.log"
    try:
        procs["g"] = cluster(leader, "g", state, log)
        wait("two accepted pushes", _accepted(state, 2), procs, 240)
        assert "model and inner steps on cuda:" in log.read_text()
        meta, saved = read_saved(state / "inner")
        assert meta["mode"] == "one" and meta["step"] >= 8
        assert all(t.device.type == "cpu" for s in saved.values() for t in s.values())
    finally:
        kill_all(procs)
