"""SIGINT or SIGTERM on `dips launch`, at every phase, stops every process cleanly and still
writes the summary; a second leader started beside the live one changes nothing and steps
down (issue 11: one leader at a time)."""

from __future__ import annotations

import json
import os
import shutil
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


def _second_leader_steps_down(run_dir: Path, tmp_path: Path) -> None:
    """A copy of the live leader's state directory started as a leader on another port: it
    takes term + 1, finds the followers leased to the live leader, and exits with code 3
    without having changed a follower."""
    from dips.emu.launcher import free_port

    copy = tmp_path / "leader-copy"
    copy.mkdir()
    for name in ("run.json", "term", "data_secret", "leader.json", "config.json"):
        shutil.copy2(run_dir / name, copy / name)
    from dips.algo.fencing import starts_of

    live_starts = int((run_dir / "term").read_text())  # the leader's start count
    terms = [int((f / "leader_term").read_text()) for f in (run_dir / "followers").iterdir()]
    assert [starts_of(t) for t in terms] == [live_starts] * len(terms)
    second = subprocess.run(
        [sys.executable, "-m", "dips.cli", "leader", "--config", str(copy / "config.json"),
         "--listen", f"127.0.0.1:{free_port()}", "--state-dir", str(copy),
         "--tls", str(run_dir / "pki" / "leader")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert second.returncode == 3, second.stderr[-2000:]
    # Refused either way: its state is behind the followers', or they stay leased to the
    # live leader (when the copy is exactly as recent as they are).
    assert ("a stale copy must not lead" in second.stderr
            or "leased to another live leader" in second.stderr), second.stderr[-2000:]
    assert int((copy / "term").read_text()) == live_starts + 1
    after = [int((f / "leader_term").read_text()) for f in (run_dir / "followers").iterdir()]
    assert after == terms  # no follower took the second leader's term
    events = jsonl_so_far(run_dir / "leader_events.jsonl")
    assert not [e for e in events if e.get("event") == "leader_stepped_down"]


def test_sigint_writes_summary_and_stops_children(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "dips.cli", "launch", "--config", str(ROOT / "configs/tiny.yaml"),
         "--run-dir", str(tmp_path / "run"), "--max-time", "300"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        deadline = time.monotonic() + 240
        log = tmp_path / "run" / "outer_steps.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if _accepted_steps(log):  # the event, not a number of seconds
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.stdout.read()
        assert _accepted_steps(log), "no outer step before the deadline"
        _second_leader_steps_down(tmp_path / "run", tmp_path)
        steps = _accepted_steps(log)
        while time.monotonic() < deadline and _accepted_steps(log) == steps:
            time.sleep(0.5)  # the live leader goes on making outer steps
        assert _accepted_steps(log) > steps
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "interrupted" in out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["interrupted"] is True
    assert summary["outer_steps"] >= 1
    assert summary["eval_loss_final"] is not None
    events = [json.loads(l) for l in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    pids = [e["pid"] for e in events if e["event"] == "start"]
    assert len(pids) == 6
    assert not [p for p in pids if _alive(p)]


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
