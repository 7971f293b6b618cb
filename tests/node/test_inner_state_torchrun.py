"""A 2-rank torchrun cluster (DDP replicas, FSDP2 shards or pipeline stages, gloo on CPU)
killed with SIGKILL after a committed round and restarted resumes its inner AdamW state
(issue 14): DDP's rank 0 saves the whole state (safetensors) and at the restart every replica
gets it back; FSDP2's ranks save and load their shards, pipeline stages the state of their own
stage's parameters, with torch.distributed.checkpoint. The state they run with after the
restart is the one in the files (every rank's, for DDP; each stage's part of it, for the
pipeline), and AdamW counts on."""

from __future__ import annotations

import pytest

from dips.roles.cluster_state import read_saved, state_digest
from dips.spec import RunSpec

from .inner_run import cluster, config, kill_all, kill_group, lines, pointer, \
    resumed_and_saved_again, roles, wait

pytestmark = [pytest.mark.integration, pytest.mark.long, pytest.mark.timeout(300)]


@pytest.mark.parametrize("parallel, storage", [("ddp", "safetensors"), ("fsdp2", "dcp"),
                                               ("pipeline", "dcp")])
def test_a_killed_torchrun_cluster_resumes_its_inner_state(tmp_path, parallel, storage):
    leader, procs = roles(tmp_path, config(tmp_path, {"id": "d", "parallel": parallel}))
    state, log = tmp_path / "d", tmp_path / "d.log"
    try:
        procs["d"] = cluster(leader, "d", state, log, ranks=2)
        wait("a committed round's inner state",
             lambda: (p := pointer(state)) and p["version"] >= 1, procs, 200)
        kill_group(procs.pop("d"))  # torchrun and both ranks
        first = pointer(state)
        meta, saved = read_saved(state / "inner")
        assert meta["mode"] == parallel and meta["storage"] == storage and meta["world"] == 2
        assert set(saved) == set(meta["params"]) and meta["step"] >= 1

        procs["d"] = cluster(leader, "d", state, log, ranks=2)
        resume, again = wait("the resumed cluster's next commit",
                             resumed_and_saved_again(state, first), procs, 200)
        assert resume["version"] == meta["version"] and resume["digest"]["step"] == meta["step"]
        if parallel == "pipeline":  # each stage's part: its layers (the tied matrix on both)
            names = {l: ns for l, ns, _ in RunSpec.read(tmp_path / "leader" / "run.json").layers}
            stages = lines(state / "train.jsonl")[0]["stages"]
            parts = [{n for l in layers for n in names[l]} for layers in stages]
            parts[-1] |= set(names["embed"])  # tiny.yaml ties the head to the embedding
            assert resume["ranks"] == [state_digest({n: saved[n] for n in part})
                                       for part in parts]
        else:
            assert resume["ranks"] == [state_digest(saved)] * (2 if parallel == "ddp" else 1)
        assert again["step"] == meta["step"] + again["counters"]["steps"] - meta["counters"]["steps"]
        assert "rank 1 of 2" in log.read_text()
    finally:
        kill_all(procs)
