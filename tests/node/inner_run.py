"""Helpers of the inner-state restart tests: a leader and followers as real processes, a
cluster (one process, or a 2-rank torchrun job) started and SIGKILLed by its own process
group, and waits on files (an event, never a duration)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import yaml

from dips.emu.launcher import free_port

from .roles import ROOT, follower_args
from .roles import dips as _dips

ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")


def config(tmp: Path, cluster: dict, **extra) -> Path:
    """tiny.yaml with the one cluster ``cluster`` and no time limit."""
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg.update(clusters=[cluster], max_time_s=None, followers=1, **extra)
    (tmp / "run.yaml").write_text(yaml.safe_dump(cfg))
    return tmp / "run.yaml"


def roles(tmp: Path, cfg: Path, follower: bool = True) -> tuple[str, dict[str, subprocess.Popen]]:
    """A leader and (``follower``) one follower on free loopback ports."""
    leader = f"127.0.0.1:{free_port()}"
    procs = {"leader": _dips(["leader", "--config", str(cfg), "--listen", leader, "--state-dir",
                              str(tmp / "leader"), "--insecure"], tmp / "leader.log")}
    if follower:
        procs["f0"] = _dips(follower_args(leader, 0, tmp / "f0"), tmp / "f0.log")
    return leader, procs


def cluster(leader: str, cid: str, state: Path, log: Path, ranks: int = 1) -> subprocess.Popen:
    """Cluster ``cid``: ``dips cluster`` (``ranks`` 1) or ``torchrun --nproc-per-node ranks
    -m dips.cluster``, in its own session (its process group is its pid)."""
    args = ["--leader", leader, "--cluster-id", cid, "--state-dir", str(state), "--insecure"]
    if ranks == 1:
        cmd = [sys.executable, "-m", "dips.cli", "cluster", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1", "--master-port",
               str(free_port()), "--max-restarts", "0", "-m", "dips.cluster", *args]
    with open(log, "a") as out:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env=ENV)


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc; torchrun's ranks lead their own
    process groups)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def kill_group(p: subprocess.Popen) -> None:
    """SIGKILL ``p``, its process group and each of its descendants by pid (torchrun's ranks),
    reap ``p`` and wait (bounded) until the descendants are gone."""
    pids = _descendants(p.pid)
    for pid in [p.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(30)
    deadline = time.monotonic() + 30
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def kill_all(procs: dict[str, subprocess.Popen]) -> None:
    for p in procs.values():
        if p.poll() is None:
            kill_group(p)


def lines(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] \
        if path.exists() else []


def pointer(state: Path) -> dict | None:
    """The cluster's ``inner/current.json`` (replaced atomically: whole or absent)."""
    path = state / "inner" / "current.json"
    return json.loads(path.read_text()) if path.exists() else None


def wait(what: str, cond: Callable[[], object], procs: dict[str, subprocess.Popen],
         limit_s: float = 120.0) -> object:
    """Poll ``cond()`` until it returns something true, and return it; fail at once if a
    process of ``procs`` exited (or after ``limit_s``, a bound, not an expectation)."""
    deadline = time.monotonic() + limit_s
    while True:
        got = cond()
        if got:
            return got
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        assert not dead and time.monotonic() < deadline, f"waiting for {what}: exited {dead}"
        time.sleep(0.1)


def resumed_and_saved_again(state: Path, first: dict) -> Callable[[], object]:
    """A condition: the restarted cluster wrote its ``resume`` record and then saved a newer
    inner state; returns (resume record, the new pointer)."""
    def cond() -> object:
        recs = lines(state / "train.jsonl")
        resume = [r for r in recs if r.get("event") == "resume"]
        now = pointer(state)
        if resume and now and now["payload"] != first["payload"] and \
                now["saved_at"] > first["saved_at"]:
            return resume[-1], now
        return None
    return cond
