"""The last point of the held-out series when the launcher's own clock (``--max-time``) ends
the run before the leader has (issue 15): the launcher asks the evaluator (SIGUSR1, once its
lock file names it: its handler is installed by then) to take the current version as the
final one, and waits for the leader to show that report; an evaluator not yet ready is not
signalled (the default action of SIGUSR1 would kill it) and just stopped. The evaluator is a
stand-in process; the leader a stand-in status; waits are for events."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dips.emu.launcher import EVALUATOR, _final_eval
from dips.node.evaluate import FINAL_SIGNAL
from dips.wire.pb import control_pb2 as pb

pytestmark = pytest.mark.timeout(60)

STAND_IN = """
import os, signal, sys, time
from pathlib import Path
state = Path(sys.argv[1])
signal.signal(signal.SIGUSR1, lambda *_: (state / "asked").write_text("final"))
if sys.argv[2] == "ready":
    (state / "lock").write_text(f"{os.getpid()}\\n")
(state / "started").write_text("")
while True:
    time.sleep(0.05)
"""


class Run:
    """What _final_eval uses of a launched run; stop() ends the stand-in (SIGTERM)."""

    def __init__(self, run_dir: Path, proc: subprocess.Popen) -> None:
        self.run_dir, self.proc, self.events = run_dir, proc, []
        self.cfg = SimpleNamespace(timeouts=SimpleNamespace(rpc_s=30.0, shutdown_s=10.0))
        self.interrupts = SimpleNamespace(check=lambda: None)

    def pid_of(self, name: str):
        assert name == EVALUATOR
        return self.proc.pid if self.proc.poll() is None else None

    def stop(self, names, timeout_s):
        assert names == [EVALUATOR]
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout_s)

    def event(self, kind, name, **extra):
        self.events.append(kind)


class Leader:
    """GetStatus of a run at version 7 that the leader has not ended: its last evaluation is
    version 7 once the stand-in evaluator was asked (it 'reports' by writing a file)."""

    def __init__(self, state: Path) -> None:
        self.state = state

    def GetStatus(self, request, timeout=None):
        reply = pb.StatusReply(version=7, finished="")
        if (self.state / "asked").exists():
            reply.last_eval.CopyFrom(pb.EvalRecord(version=7, eval_loss=5.0))
        return reply


def start(tmp_path: Path, ready: bool) -> Run:
    state = tmp_path / EVALUATOR
    state.mkdir()
    if not ready:
        (state / "lock").write_text("1\n")  # a previous process's pid
    proc = subprocess.Popen([sys.executable, "-c", STAND_IN, str(state),
                             "ready" if ready else "loading"])
    deadline = time.monotonic() + 30.0  # the event: the stand-in is up
    while not (state / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return Run(tmp_path, proc)


def test_the_launchers_clock_ending_the_run_still_gets_the_final_report(tmp_path):
    assert FINAL_SIGNAL == signal.SIGUSR1
    run = start(tmp_path, ready=True)
    try:
        leader = Leader(tmp_path / EVALUATOR)
        status = _final_eval(run, leader, leader.GetStatus(None))
        assert status.last_eval.version == 7 and run.events == ["final_eval_asked"]
        assert run.proc.poll() is not None  # stopped afterwards
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()


def test_an_evaluator_not_ready_for_the_signal_is_only_stopped(tmp_path):
    run = start(tmp_path, ready=False)
    try:
        leader = Leader(tmp_path / EVALUATOR)
        status = _final_eval(run, leader, leader.GetStatus(None))
        assert not status.HasField("last_eval") and run.events == []
        assert run.proc.wait(10) == -signal.SIGTERM  # stopped, not killed by SIGUSR1
        assert not (tmp_path / EVALUATOR / "asked").exists()
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
