"""``dips launch`` refuses, before any process starts, a cluster that could not start (review
32 of issue 14): ``parallel`` without ``ranks``, more pipeline ranks than decoder blocks, a
device this host does not have; each error names the entry, the field and its value. And a
cluster that exits 2 (it could not start) is not restarted in a loop; one that fails is."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from dips.emu.children import Launch
from dips.emu.preflight import check_clusters
from dips.spec import ClusterConfig, RunConfig, SpecError

ROOT = Path(__file__).resolve().parents[2]
KEYS = ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]


def _cfg(*clusters: dict) -> RunConfig:
    return RunConfig(clusters=[ClusterConfig(**c) for c in clusters])


def test_parallel_given_to_a_cluster_of_one_process_is_refused_naming_entry_and_value():
    with pytest.raises(SpecError, match=r"clusters\[1\] \(id 'p4'\): parallel = 'fsdp2' with "
                                        r"ranks = 1"):
        check_clusters(_cfg({"id": "a"}, {"id": "p4", "parallel": "fsdp2"}), KEYS)
    check_clusters(_cfg({"id": "a"}, {"id": "b", "parallel": "fsdp2", "ranks": 2}), KEYS)


def test_more_pipeline_ranks_than_decoder_blocks_is_refused_by_the_pipelines_own_rule():
    with pytest.raises(SpecError, match=r"clusters\[0\] \(id 'c'\): ranks = 8: parallel = "
                                        r"'pipeline': 4 decoder blocks for 8 stages"):
        check_clusters(_cfg({"id": "c", "parallel": "pipeline", "ranks": 8}), KEYS)
    check_clusters(_cfg({"id": "c", "parallel": "pipeline", "ranks": 4}), KEYS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU host's refusal")
def test_a_cuda_device_on_a_cpu_host_is_refused_before_anything_starts():
    with pytest.raises(SpecError, match=r"clusters\[0\] \(id 'g'\): device = 'cuda', but CUDA "
                                        r"is not available here"):
        check_clusters(_cfg({"id": "g", "device": "cuda", "ranks": 2}), KEYS)
    check_clusters(_cfg({"id": "g", "device": "cpu", "ranks": 2}), KEYS)


def test_a_cluster_that_exits_2_is_not_restarted_one_that_fails_otherwise_is(tmp_path,
                                                                             monkeypatch):
    run = Launch(_cfg({"id": "a"}, {"id": "b"}), tmp_path, Console(quiet=True))
    codes = {"cluster-a": 2, "cluster-b": 1}
    monkeypatch.setattr(Launch, "command_of", lambda self, name, args: [
        sys.executable, "-c", f"raise SystemExit({codes[name]})"])
    for name in codes:
        run.spawn(name, ["cluster"])
    for _ in range(2):  # a child given up is neither restarted nor logged again
        for c in run.children.values():
            c.proc.wait(60)
        run.supervise()
    seen = [(e["event"], e["process"]) for e in run.events if e["event"] != "start"]
    assert seen == [("exited", "cluster-a"), ("not_restarted", "cluster-a"),
                    ("exited", "cluster-b"), ("restart", "cluster-b"),
                    ("exited", "cluster-b"), ("restart", "cluster-b")], seen
    for c in run.children.values():
        c.proc.wait(60)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU host's refusal")
def test_dips_launch_refuses_it_before_it_starts_any_process(tmp_path):
    from dips.emu.launcher import launch
    from dips.spec import load_config

    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    cfg = cfg.model_copy(update={"clusters": [ClusterConfig(id="a"), ClusterConfig(
        id="b", ranks=2, device="cuda")]})
    with pytest.raises(SpecError, match=r"clusters\[1\] \(id 'b'\): device = 'cuda'"):
        launch(cfg, tmp_path / "run", console=Console(quiet=True))
    assert not (tmp_path / "run" / "logs").exists()  # no process was started
