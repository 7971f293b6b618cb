"""A torchrun rank leaves with its agent (review 14, F3): torchrun starts each rank in a
session of its own, so a kill -9 of the agent alone used to leave both ranks training and
pushing as the cluster, whose state directory then stayed locked. Here a parent process (the
agent's stand-in) starts a child that calls ``exit_with_agent``; the parent is killed with
SIGKILL and the child must exit (status 1) by itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from .roles import alive

pytestmark = pytest.mark.timeout(120)

CHILD = """
import sys, time
from dips.node.cluster_ddp import exit_with_agent
exit_with_agent(poll_s=0.1)
print("watching", flush=True)
time.sleep(100)
"""

PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True,
                         stdout=open(sys.argv[2], "w"), stderr=subprocess.STDOUT)
print(child.pid, flush=True)
time.sleep(100)
"""


def test_a_rank_exits_once_its_agent_is_killed(tmp_path):
    log = tmp_path / "child.log"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(log)],
                              stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 60
        while "watching" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, "the child never started watching"
            time.sleep(0.1)
        assert alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 30
        while alive(child):
            assert time.monotonic() < deadline, "the rank outlived its agent"
            time.sleep(0.1)
        assert "the torchrun agent" in log.read_text() and "is gone" in log.read_text()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        if child is not None and alive(child):
            os.kill(child, signal.SIGKILL)
