"""Role processes (``dips leader|follower|cluster …``) started by the node tests: one way to
start them, to stop them cleanly and to kill whatever a failed test left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from dips.emu.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]


def dips(args: list[str], log: Path | None = None) -> subprocess.Popen:
    """``python -m dips.cli ARGS`` in its own session; output to ``log`` (or pipes if None)."""
    out = open(log, "w") if log is not None else subprocess.PIPE
    try:
        return subprocess.Popen([sys.executable, "-m", "dips.cli", *args], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT if log is not None else subprocess.PIPE,
                                text=True, start_new_session=True,
                                env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
    finally:
        if log is not None:
            out.close()  # the child holds its own copy


def follower_args(leader: str, index: int, state: Path, *extra: str) -> list[str]:
    """Arguments of follower ``index`` of the leader at ``leader`` on free loopback ports."""
    return ["follower", "--leader", leader, "--index", str(index), "--listen",
            f"127.0.0.1:{free_port()}", "--data-listen", f"127.0.0.1:{free_port()}",
            "--state-dir", str(state), "--insecure", *extra]


def start_roles(tmp: Path, cfg: Path, followers: int) -> tuple[str, dict[str, subprocess.Popen]]:
    """A leader (``cfg``, no TLS, state and log in ``tmp``) and ``followers`` followers on
    127.0.0.1: (leader address, {"leader": ..., "f0": ...})."""
    leader = f"127.0.0.1:{free_port()}"
    procs = {"leader": dips(["leader", "--config", str(cfg), "--listen", leader, "--state-dir",
                             str(tmp / "leader"), "--insecure"], tmp / "leader.log")}
    for i in range(followers):
        procs[f"f{i}"] = dips(follower_args(leader, i, tmp / f"f{i}"), tmp / f"f{i}.log")
    return leader, procs


def stop_cleanly(procs: dict[str, subprocess.Popen], names: tuple[str, ...]) -> None:
    """SIGTERM each of ``names`` (in order), then assert each exits 0 within 60 s."""
    for name in names:
        procs[name].send_signal(signal.SIGTERM)
    for name in names:
        assert procs[name].wait(60) == 0, name


def kill_left(procs: dict[str, subprocess.Popen]) -> None:
    """Kill every process of ``procs`` still running (a failed test's leftovers)."""
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait(10)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (exists and is not a zombie), from /proc."""
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
    except (OSError, IndexError):
        return False
    return "zombie" not in state
