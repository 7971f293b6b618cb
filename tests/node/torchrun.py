"""Clusters as torchrun jobs for the node tests (issue 14): one way to start one, and to read
what the roles wrote (records, decisions) while waiting for events, never for durations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from dips.emu.launcher import free_port

from .roles import ROOT


def torchrun(cluster: str, leader: str, state: Path, log: Path, nproc: int = 2,
             restarts: int = 0) -> subprocess.Popen:
    """Cluster ``cluster`` as ``torchrun --nproc-per-node NPROC --max-restarts RESTARTS -m
    dips.cluster`` (own session, output appended to ``log``, rendezvous on a free loopback
    port)."""
    with open(log, "a") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
             "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port",
             str(free_port()), "--max-restarts", str(restarts), "-m", "dips.cluster",
             "--leader", leader, "--cluster-id", cluster, "--state-dir", str(state),
             "--insecure"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))


def lines(path: Path) -> list[dict]:
    """The JSON lines of ``path`` ([] if it does not exist yet)."""
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] \
        if path.exists() else []


def decisions(leader_dir: Path) -> dict[int, dict]:
    """The leader's outer steps by version (``outer_steps.jsonl`` lines with ``accepted``)."""
    return {d["version"]: d for d in lines(leader_dir / "outer_steps.jsonl") if "accepted" in d}


def wait(what: str, cond: Callable[[], object], procs: dict[str, subprocess.Popen],
         limit_s: float = 200.0) -> None:
    """Poll ``cond()`` until true (an event in a file); fail at once if a process of
    ``procs`` exited, or after ``limit_s`` seconds (a hung run, not a slow one)."""
    deadline = time.monotonic() + limit_s
    while not cond():
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        assert not dead and time.monotonic() < deadline, f"waiting for {what}: exited {dead}"
        time.sleep(0.2)
