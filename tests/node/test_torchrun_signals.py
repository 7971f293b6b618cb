"""Signals to a cluster that is a torchrun job (issue 14, review 32): torchrun starts every rank
in a session of its own, so a signal to its process group reaches the agent alone.

* A fault plan's ``stop`` stops every rank, and its ``cont`` resumes them (it stopped the agent
  only, and the ranks trained on).
* ``python -m dips.torchrun`` (torchrun that passes SIGTERM on to the ranks) exits 0 without a
  traceback when its ranks stop (plain torchrun: exit 1 and a SignalException traceback).
* ``python -m dips.torchrun`` exits 2 (could not start: a configuration error) when every
  failed rank exited 2, as ``dips cluster`` does (torchrun: 1 for any failure), so that
  ``dips launch`` does not restart it.
* A rank SIGTERMed while it waits in ``init_process_group`` for a peer that never comes exits
  at once (it waited in C++ for 1800 s, never running its Python handler).

No leader is needed: the ranks wait in their start-up (rank 0 for the leader, the others for
rank 0), which is what these tests signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dips.emu.faults import Fault, FaultInjector, FaultPlan
from dips.emu.launcher import free_port
from dips.emu.proctree import children, job_pids

from .roles import ROOT, kill_job, state

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _job(tmp: Path, module: str, creds: tuple[str, ...] = ("--insecure",)) -> subprocess.Popen:
    """Cluster ``d`` as ``python -m MODULE --nproc-per-node 2 -m dips.cluster`` against a
    leader address nobody serves (own session; output to ``tmp/d.log``)."""
    with open(tmp / "d.log", "a") as out:
        return subprocess.Popen(
            [sys.executable, "-m", module, "--nnodes", "1", "--nproc-per-node", "2",
             "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
             "--max-restarts", "0", "-m", "dips.cluster", "--leader",
             f"127.0.0.1:{free_port()}", "--cluster-id", "d", "--state-dir", str(tmp / "d"),
             *creds], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))


def _until(what: str, cond, job: subprocess.Popen | None = None, limit_s: float = 200.0,
           detail=lambda: ""):
    """Poll ``cond()`` until it returns a true value (returned): fail after ``limit_s`` s (a
    hang, not a slow machine) or, given ``job``, once it exited."""
    deadline = time.monotonic() + limit_s
    while not (value := cond()):
        assert job is None or job.poll() is None, f"{what}: the job exited {job.returncode}"
        assert time.monotonic() < deadline, f"waiting for {what}{detail()}"
        time.sleep(0.05)
    return value


def _argv(pid: int) -> list[bytes]:
    """The arguments of process ``pid`` ([] once gone); before its exec a child has its
    parent's, the agent's."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def _ranks(job: subprocess.Popen) -> list[int]:
    def both() -> list[int] | None:  # both exec'd (a parent in vfork sleeps uninterruptibly)
        ranks = [r for r in children(job.pid)
                 if not {b"dips.torchrun", b"torch.distributed.run"} & set(_argv(r))]
        return ranks if len(ranks) == 2 else None

    return _until("both ranks started", both, job)


def _started(tmp: Path) -> bool:
    """Rank 0 installed its signal handlers (it then warns about --insecure)."""
    return "running WITHOUT TLS" in (tmp / "d.log").read_text()


def test_a_fault_plans_stop_stops_every_rank_of_a_torchrun_cluster_and_cont_resumes_them(
        tmp_path):
    job = _job(tmp_path, "torch.distributed.run")
    pids: list[int] = []
    try:
        ranks = _ranks(job)
        pids = job_pids(job.pid)
        assert all(os.getsid(r) == r for r in ranks)  # each rank leads its own session
        events = []
        inj = FaultInjector(FaultPlan(faults=[
            Fault(at_s=1.0, action="stop", target="cluster-d", duration_s=5.0)]),
            lambda name: job.pid, tmp_path / "fp", lambda *a, **kw: events.append(kw))
        inj.tick(1.0)
        _until("the agent and both ranks stopped",
               lambda: all(state(p) == "T" for p in [job.pid, *ranks]),
               detail=lambda: f": {[(p, state(p)) for p in job_pids(job.pid)]} {events}")
        assert set(ranks) <= set(events[-1]["pids"])
        inj.tick(6.0)
        _until("the agent and both ranks resumed",
               lambda: all(state(p) not in ("T", None) for p in [job.pid, *ranks]))
    finally:
        kill_job(job, pids)


def test_dips_torchrun_passes_sigterm_to_the_ranks_and_exits_0_without_a_traceback(tmp_path):
    job = _job(tmp_path, "dips.torchrun")
    pids: list[int] = []
    try:
        ranks = _ranks(job)
        pids = job_pids(job.pid)
        _until("rank 0 started", lambda: _started(tmp_path), job)
        job.send_signal(signal.SIGTERM)
        assert job.wait(120) == 0, (tmp_path / "d.log").read_text()[-3000:]
        log = (tmp_path / "d.log").read_text()
        assert "Traceback" not in log and "SignalException" not in log, log[-3000:]
        assert "SIGTERM passed to the ranks" in log
        _until("both ranks gone", lambda: all(state(r) is None for r in ranks))
    finally:
        kill_job(job, pids)


def test_a_rank_waiting_for_a_peer_in_init_process_group_exits_at_once_on_sigterm(tmp_path):
    job = _job(tmp_path, "torch.distributed.run")
    pids: list[int] = []
    try:
        rank0, rank1 = _ranks(job)
        pids = job_pids(job.pid)
        os.kill(rank1, signal.SIGSTOP)  # a peer that never connects: rank 0 waits in C++
        _until("rank 0 started", lambda: _started(tmp_path), job)
        os.kill(rank0, signal.SIGTERM)
        _until("rank 0 gone (it waited 1800 s for rank 1)", lambda: state(rank0) is None,
               limit_s=120.0)
        assert f"during start-up: this rank (pid {rank0}) exits now" in \
            (tmp_path / "d.log").read_text()
    finally:
        kill_job(job, pids)


def test_dips_torchrun_exits_2_when_the_cluster_could_not_start(tmp_path):
    job = _job(tmp_path, "dips.torchrun", creds=())  # neither --tls nor --insecure: rank 0 exits 2
    try:
        assert job.wait(200) == 2, (tmp_path / "d.log").read_text()[-3000:]
        log = (tmp_path / "d.log").read_text()
        assert "give exactly one of --tls DIR" in log and "Traceback" not in log, log[-3000:]
    finally:
        kill_job(job, [])
