"""SIGINT or SIGTERM on `dips launch`, at every phase, stops every process cleanly and still
writes the summary; a second leader started beside the live one changes nothing and steps
down (issue 11: one leader at a time; on the shared run: test_quiet_run.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.runner import jsonl_so_far

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


def _launch(run_dir: Path, preexec=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dips.cli", "launch", "--config", str(ROOT / "configs/tiny.yaml"),
         "--run-dir", str(run_dir), "--max-time", "300"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"), preexec_fn=preexec)


def _wait_event(proc: subprocess.Popen, path: Path, cond, what: str) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if any(cond(e) for e in jsonl_so_far(path)):
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} never happened (exit {proc.poll()})")


@pytest.mark.parametrize("phase", ["start-up", "prepare"])
def test_a_signal_at_any_phase_stops_everything_and_writes_the_summary(tmp_path, phase):
    """start-up: SIGTERM once the leader started (followers registering). prepare: SIGINT to a
    launcher that inherited SIGINT as ignored (as from `&` in a non-interactive shell), sent as
    soon as the run directory exists."""
    run_dir = tmp_path / "run"
    if phase == "start-up":
        proc = _launch(run_dir)
        sig = signal.SIGTERM
    else:
        proc = _launch(run_dir, preexec=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        sig = signal.SIGINT
    try:
        if phase == "start-up":
            _wait_event(proc, run_dir / "events.jsonl",
                        lambda e: e.get("event") == "start" and e.get("process") == "leader",
                        "the leader's start")
        else:
            deadline = time.monotonic() + 60
            while not (run_dir / "pki").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "Traceback" not in out, out[-3000:]
    assert f"during {phase}" in out or "interrupted" in out, out[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["eval_loss_final"] is None
    events = jsonl_so_far(run_dir / "events.jsonl")
    pids = [e["pid"] for e in events if e.get("event") == "start"]
    assert not [p for p in pids if _alive(p)]
