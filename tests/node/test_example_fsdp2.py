"""``examples/fsdp2_loop.py`` (a user's own loop under torchrun with FSDP2 and
:class:`dips.node.job.ClusterJob`) runs as a 2-rank cluster against a real leader and two
real followers (gloo on CPU) until the run's last outer step, every push accepted: the
example cannot rot unnoticed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from dips.emu.launcher import free_port

from .roles import ROOT, kill_left, start_roles, stop_cleanly
from .torchrun import decisions

pytestmark = pytest.mark.timeout(300)

EXAMPLE = ROOT / "examples" / "fsdp2_loop.py"


def test_the_example_is_short():
    assert len(EXAMPLE.read_text().splitlines()) <= 120


@pytest.mark.long  # make test-long (FSDP2 under torchrun: test_ddp_cluster.py in make test)
@pytest.mark.integration
def test_the_fsdp2_example_trains_as_a_cluster_until_the_run_ends(tmp_path):
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg.update(clusters=[{"id": "e"}], max_time_s=None, max_outer_steps=3)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    leader, procs = start_roles(tmp_path, tmp_path / "run.yaml", 2)
    log = tmp_path / "e.log"
    with open(log, "w") as out:
        procs["e"] = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
             "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
             str(free_port()), str(EXAMPLE), "--leader", leader, "--cluster-id", "e",
             "--insecure"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
    try:
        assert procs["e"].wait(240) == 0, log.read_text()[-3000:]
        decided = decisions(tmp_path / "leader")
        assert len(decided) >= 3 and all(d["accepted"] == ["e"] for d in decided.values())
        printed = [l for l in log.read_text().splitlines() if "pushed accepted" in l]
        assert len(printed) >= 3, log.read_text()[-3000:]
        assert "steps: the run finished (max outer steps)" in log.read_text()
        stop_cleanly(procs, ("f0", "f1", "leader"))
    finally:
        kill_left(procs)
