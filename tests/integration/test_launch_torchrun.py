"""``dips launch`` with a cluster of ``ranks: 2`` (issue 14, emulation): that cluster runs as
one torchrun job of two DDP ranks next to a one-process cluster. A kill -9 of it (a fault
plan's ``kill`` of ``cluster-d``) takes its ranks down with it, the launcher restarts the
job, it re-joins and is accepted again; at the end the launcher's SIGTERM stops it with exit
0 and no rank of any start is left running."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from tests.integration.invariants import check_run
from tests.integration.runner import ROOT, jsonl_so_far, launch_until
from tests.node.roles import alive

pytestmark = [pytest.mark.integration, pytest.mark.long, pytest.mark.timeout(600)]


def _accepted_after(run_dir: Path, cluster: str, t: float) -> bool:
    return any(cluster in d.get("accepted", []) and d.get("time", 0.0) > t
               for d in jsonl_so_far(run_dir / "outer_steps.jsonl"))


def test_a_two_rank_cluster_is_one_torchrun_job_killed_and_restarted_whole(tmp_path):
    cfg = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())
    cfg.update(clusters=[{"id": "a"}, {"id": "d", "ranks": 2, "parallel": "ddp"}],
               max_time_s=None)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "faults.yaml").write_text(
        "faults:\n  - {target: cluster-d, action: kill, at_s: 5}\n")
    run_dir = tmp_path / "run"
    ranks: dict[int, float] = {}  # pid of each rank process of cluster d seen -> when first seen

    def missing(run_dir: Path) -> str | None:
        for pid in _ranks_of(run_dir / "clusters" / "d"):
            ranks.setdefault(pid, time.time())
        events = jsonl_so_far(run_dir / "events.jsonl")
        restarted = [e for e in events if e["event"] == "restart" and e["process"] == "cluster-d"]
        if not restarted:
            return "cluster-d killed and restarted"
        # After its re-join: a push of the killed job decided after the restart is no proof.
        back = [e["time"] for e in jsonl_so_far(run_dir / "leader_events.jsonl")
                if e.get("event") == "cluster_joined" and e.get("cluster") == "d"
                and e.get("rejoin") and e["time"] > restarted[0]["time"]]
        if not back or not _accepted_after(run_dir, "d", back[0]):
            return "a push of the restarted cluster-d accepted"
        return None

    out = launch_until(["--config", str(tmp_path / "run.yaml"), "--faults",
                        str(tmp_path / "faults.yaml"), "--max-time", "500"], run_dir, missing,
                       deadline_s=420)
    check_run(run_dir)
    events = jsonl_so_far(run_dir / "events.jsonl")
    killed = next(e["time"] for e in events if e["event"] == "fault" and e["process"] == "cluster-d")
    before = [p for p, seen in ranks.items() if seen < killed]
    # torchrun starts its ranks within seconds, the training clock only once clusters joined.
    assert len(before) == 2, (ranks, killed)
    assert len(ranks) >= 4, ranks  # the restarted job's two ranks too
    deadline = time.monotonic() + 30
    while left := [p for p in ranks if alive(p)]:  # the launcher's stop reached every rank
        assert time.monotonic() < deadline, f"ranks left running: {left}\n{out[-2000:]}"
        time.sleep(0.2)
    log = (run_dir / "logs" / "cluster-d.log").read_text()
    assert "rank 1 of 2" in log
    # Its end: SIGTERM reached the ranks (python -m dips.torchrun), which stopped together,
    # and torchrun exited 0, without a SignalException traceback (review 32).
    stopped = [e for e in jsonl_so_far(run_dir / "events.jsonl")
               if e["event"] == "stopped" and e["process"] == "cluster-d"]
    assert [e["returncode"] for e in stopped] == [0], stopped
    assert "SignalException" not in log and "stopping after" in log, log[-3000:]
    assert (run_dir / "clusters" / "a" / "train.jsonl").exists()


def _ranks_of(state: Path) -> list[int]:
    """Pids of the rank processes (``-m dips.cluster``, not torchrun or dips.torchrun) whose
    ``--state-dir`` is ``state``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        agents = {b"torch.distributed.run", b"dips.torchrun"}
        if b"dips.cluster" in argv and not agents & set(argv) and str(state).encode() in argv:
            out.append(int(entry.name))
    return out
