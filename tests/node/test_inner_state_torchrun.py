"""A 2-rank torchrun cluster (DDP replicas or FSDP2 shards, gloo on CPU) killed with SIGKILL
after a committed round and restarted resumes its inner AdamW state (issue 14): DDP's rank 0
saves the whole state (safetensors) and at the restart every replica gets it back; FSDP2's
ranks save and load their shards with torch.distributed.checkpoint. The state they run with
after the restart is the one in the files (every rank's, for DDP), and AdamW counts on."""

from __future__ import annotations

import pytest

from dips.roles.cluster_state import read_saved, state_digest

from .inner_run import cluster, config, kill_all, kill_group, pointer, resumed_and_saved_again, \
    roles, wait

pytestmark = [pytest.mark.integration, pytest.mark.long, pytest.mark.timeout(300)]


@pytest.mark.parametrize("parallel, storage", [("ddp", "safetensors"), ("fsdp2", "dcp")])
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
        assert resume["ranks"] == [state_digest(saved)] * (2 if parallel == "ddp" else 1)
        assert again["step"] == meta["step"] + again["counters"]["steps"] - meta["counters"]["steps"]
        assert "rank 1 of 2" in log.read_text()
    finally:
        kill_all(procs)
