"""Ctrl-C on `dips launch` stops every process cleanly and still writes the summary."""

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


def _accepted_steps(log: Path) -> int:
    """Outer steps (rounds with an accepted update) the leader has logged so far."""
    return sum(1 for r in jsonl_so_far(log) if r.get("accepted"))


def test_sigint_writes_summary_and_stops_children(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "dips.cli", "launch", "--config", str(ROOT / "configs/tiny.yaml"),
         "--run-dir", str(tmp_path), "--max-time", "300"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        deadline = time.monotonic() + 240
        log = tmp_path / "outer_steps.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if _accepted_steps(log):  # the event, not a number of seconds
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.stdout.read()
        assert _accepted_steps(log), "no outer step before the deadline"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "interrupted" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["interrupted"] is True
    assert summary["outer_steps"] >= 1
    assert summary["eval_loss_final"] is not None
    events = [json.loads(l) for l in (tmp_path / "events.jsonl").read_text().splitlines()]
    pids = [e["pid"] for e in events if e["event"] == "start"]
    assert len(pids) == 6
    assert not [p for p in pids if _alive(p)]
