"""Role processes (``dips leader|follower|cluster …``) started by the node tests: one way to
start them, to stop them cleanly and to kill whatever a failed test left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dips.emu.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]


def dips(args: list[str], log: Path | None = None) -> subprocess.Popen:
    """``python -m dips.cli ARGS`` in its own session; output to ``log`` (or pipes if None)."""
    out = open(log, "w") if log is not None else subprocess.PIPE
    try:
        proc = subprocess.Popen([sys.executable, "-m", "dips.cli", *args], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT if log is not None else subprocess.PIPE,
                                text=True, start_new_session=True,
                                env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
        proc.log = log  # where stop_cleanly finds its stacks
        return proc
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
    """SIGTERM each of ``names`` (in order), then assert each exits 0 within 60 s; one that
    does not is asked for its threads' stacks (SIGUSR1), which the failure shows."""
    for name in names:
        procs[name].send_signal(signal.SIGTERM)
    for name in names:
        try:
            code = procs[name].wait(60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} did not stop in 60 s:\n{_stacks(procs[name])}") from None
        assert code == 0, name


def _stacks(proc: subprocess.Popen) -> str:
    """The end of ``proc``'s log once it holds the stacks ``proc`` writes there on SIGUSR1
    (the dump names the signalled thread "Current thread"), or after 30 s."""
    log = getattr(proc, "log", None)
    if log is None:
        return "(no log)"
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 30.0
    while "Current thread" not in Path(log).read_text(errors="replace") \
            and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    return Path(log).read_text(errors="replace")[-12000:]


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


def state(pid: int) -> str | None:
    """Process ``pid``'s state letter from /proc (``T``: stopped), None once it is gone or a
    zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    letter = stat[stat.rindex(")") + 2]
    return None if letter in "ZX" else letter


def kill_job(proc: subprocess.Popen, pids: list[int]) -> None:
    """SIGKILL each of ``pids`` still running (a job's processes, found while it ran), then
    ``proc`` itself, and reap it."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.wait(30)
