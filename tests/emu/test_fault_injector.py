"""The fault injector's dispatch (the kernel link cut itself is tests/integration/
test_multihost.py's): a cut_link in network namespaces takes the cluster's veth down and up
again after its duration; without namespaces it writes the failpoint the cluster reads."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from dips.emu.faults import Fault, FaultInjector, FaultPlan
from dips.emu.proctree import job_pids
from tests.node.roles import kill_job, state


class FakeNet:
    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def set_link(self, cluster: str, up: bool) -> None:
        self.calls.append((cluster, up))


def _run(tmp_path, net):
    events = []
    plan = FaultPlan(faults=[Fault(at_s=2.0, action="cut_link", target="cluster-a", duration_s=3.0)])
    inj = FaultInjector(plan, lambda name: None, tmp_path / "fp",
                        lambda kind, proc, **kw: events.append((kind, proc, kw)), net)
    for t in (1.0, 2.0, 4.9):
        inj.tick(t)
    marker = (tmp_path / "fp" / "cluster-a.link_down").exists()
    inj.tick(5.0)
    return events, marker, (tmp_path / "fp" / "cluster-a.link_down").exists()


def test_a_cut_link_in_namespaces_takes_the_veth_down_then_up(tmp_path):
    net = FakeNet()
    events, marker, after = _run(tmp_path, net)
    assert net.calls == [("a", False), ("a", True)]
    assert not marker and not after
    assert [(k, kw.get("how")) for k, _, kw in events] == [("fault", "netns"), ("fault_cleared", None)]


def test_a_cut_link_on_loopback_is_a_failpoint(tmp_path):
    events, marker, after = _run(tmp_path, None)
    assert marker and not after
    assert events[0][2]["how"] == "failpoint"


def test_a_phase_fault_is_recorded_with_the_time_the_process_wrote(tmp_path):
    """The marker is read only once whole: an empty one (seen between its creation and its
    write) once made the launcher record its own later time, after the restart it caused,
    and a test waiting for "a restart after the fault" never saw one (fresh-clone check,
    2026-12-04)."""
    events = []
    plan = FaultPlan(faults=[Fault(after_s=1.0, phase="pull", action="kill", target="follower-1")])
    inj = FaultInjector(plan, lambda name: 123, tmp_path / "fp",
                        lambda kind, proc, **kw: events.append((kind, proc, kw)))
    inj.tick(1.0)
    assert (tmp_path / "fp" / "follower-1.pull").exists()
    marker = tmp_path / "fp" / "follower-1.pull.fired"
    marker.write_text("")
    inj.tick(2.0)
    assert [k for k, _, _ in events] == ["fault_armed"]
    marker.write_text("1234.5")
    inj.tick(3.0)
    assert events[-1] == ("fault", "follower-1", {"action": "kill", "phase": "pull",
                                                  "fired_at": 1234.5})


def test_a_failpoint_writes_its_marker_whole(tmp_path, monkeypatch):
    from dips.roles import failpoints

    kills = []
    monkeypatch.setattr(failpoints, "_DIR", str(tmp_path))
    monkeypatch.setattr(failpoints, "_NAME", "follower-1")
    monkeypatch.setattr(failpoints.os, "kill", lambda pid, sig: kills.append(sig))
    (tmp_path / "follower-1.push").write_text("armed")
    failpoints.hit("push")
    assert float((tmp_path / "follower-1.push.fired").read_text()) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["follower-1.push.fired"]
    assert len(kills) == 1


# A job like torchrun's: an agent whose two "ranks" each lead a session of their own.
AGENT = ("import subprocess, sys, time\n"
         "ranks = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],"
         " start_new_session=True) for _ in range(2)]\n"
         "time.sleep(600)\n")


def _execd(agent: int) -> list[int]:
    """The agent and those of its children that run their own program, from /proc."""
    def program(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""
    return [agent] + [p for p in job_pids(agent)[1:] if b"subprocess" not in program(p)]


def _until(what: str, cond) -> None:
    deadline = time.monotonic() + 60  # a hung test, not a slow one
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_stop_and_kill_reach_every_process_of_a_job_whose_ranks_lead_their_own_sessions(tmp_path):
    agent = subprocess.Popen([sys.executable, "-c", AGENT], start_new_session=True)
    pids: list[int] = []
    try:
        # Both exec'd: a parent in vfork sleeps uninterruptibly until its child execs.
        _until("the two ranks started", lambda: len(_execd(agent.pid)) == 3)
        pids = _execd(agent.pid)
        ranks = pids[1:]
        assert all(os.getsid(r) == r for r in ranks)  # as torchrun's: not the agent's group
        events = []
        plan = FaultPlan(faults=[
            Fault(at_s=1.0, action="stop", target="cluster-d", duration_s=4.0),
            Fault(at_s=9.0, action="kill", target="cluster-d")])
        inj = FaultInjector(plan, lambda name: agent.pid if agent.poll() is None else None,
                            tmp_path / "fp", lambda kind, proc, **kw: events.append((kind, kw)))
        inj.tick(1.0)
        _until("every process stopped", lambda: [state(p) for p in pids] == ["T"] * 3)
        assert events[-1][0] == "fault" and sorted(events[-1][1]["pids"]) == sorted(pids)
        inj.tick(5.0)
        _until("every process resumed", lambda: all(state(p) in ("S", "R") for p in pids))
        assert events[-1][0] == "fault_cleared"
        inj.tick(9.0)
        agent.wait(30)
        _until("every rank killed", lambda: all(state(p) is None for p in ranks))
    finally:
        kill_job(agent, pids)
