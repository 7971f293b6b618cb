"""A role process ends within its exit bound whatever still runs (CI stop 27: a leader that
had stopped did not exit in 60 s): :func:`dips.node.common.run_bounded`, the entry points'
wrapper."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

#: A process whose interpreter shutdown would wait forever: a non-daemon thread blocked on
#: an event nobody sets (as a gRPC handler thread stuck in a call is joined at exit).
STUCK = """
import sys, threading
from dips.node import common
from dips.node.common import run_bounded, setup_logging
setup_logging("stuck")
common.EXIT_BOUND_S = float(sys.argv[2])

def entry():  # a command that ends as a typer app does
    if sys.argv[3] == "stuck":
        threading.Thread(target=threading.Event().wait, name="stuck-handler").start()
    sys.exit(int(sys.argv[1]))

run_bounded(entry)
"""


@pytest.mark.parametrize("code", [0, 3])
def test_a_stuck_thread_does_not_hold_the_exit(code):
    out = subprocess.run([sys.executable, "-c", STUCK, str(code), "0.5", "stuck"], capture_output=True,
                         text=True, timeout=50)
    assert out.returncode == code
    assert "exit still waits on threads after 0.5 s" in out.stderr
    assert "stuck-handler" in out.stderr or "threading.py" in out.stderr  # the stacks


def test_a_clean_exit_is_not_forced():
    out = subprocess.run([sys.executable, "-c", STUCK, "0", "30", "clean"], capture_output=True,
                         text=True, timeout=50)
    assert out.returncode == 0 and "exit still waits" not in out.stderr
