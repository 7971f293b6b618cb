"""The launcher's liveness probe of the leader (review 21, F2): a silent leader that uses CPU
is busy, one that uses none is hung (dips.algo.liveness.leader_hung). Reads real /proc
counters of processes this test starts; no timing assertion."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from dips.algo.liveness import leader_hung
from dips.emu.children import CpuWindow, cpu_seconds

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")]


def state(pid: int) -> str:
    stat = open(f"/proc/{pid}/stat").read()
    return stat[stat.rindex(")") + 2]


def test_a_stopped_process_uses_no_cpu_and_is_judged_hung():
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        window = CpuWindow(3.0)
        assert window.sample(child.pid, 0.0) is None  # one sample: nothing known yet
        while (cpu_seconds(child.pid) or 0.0) < 0.05:  # it runs: its counter moves
            pass
        busy = window.sample(child.pid, 1.0)
        assert busy is not None and busy > 0.0
        os.kill(child.pid, signal.SIGSTOP)
        while state(child.pid) != "T":  # stopped (the signal is delivered asynchronously)
            pass
        stopped = CpuWindow(3.0)
        stopped.sample(child.pid, 10.0)
        assert stopped.sample(child.pid, 13.0) == 0.0
        assert leader_hung(3.7, stopped.sample(child.pid, 13.0), 3.0)
        assert not leader_hung(3.7, 0.5, 3.0)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)


def test_another_process_or_a_gone_one_starts_afresh():
    window = CpuWindow(3.0)
    window.sample(os.getpid(), 0.0)
    assert window.sample(None, 1.0) is None
    assert window.sample(2**22 + 12345, 2.0) is None  # no such pid
    assert cpu_seconds(2**22 + 12345) is None
