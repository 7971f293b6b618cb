"""Run `dips launch` until an event has happened, then stop it as Ctrl-C does.

A test that needs "the fault fired, the run recovered and went on" waits for exactly that (a
condition on the run directory, polled with a deadline) instead of guessing how many seconds
it takes on a loaded machine. The stop is the documented Ctrl-C: the launcher stops every
process in order, lets the last round finish and still writes the summary.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]


def jsonl_so_far(path: Path) -> list[dict]:
    """The complete lines of a JSONL file another process is still appending to (a last line
    caught half-written is left for the next look)."""
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]


def launch_until(args: list[str], run_dir: Path, until: Callable[[Path], str | None],
                 deadline_s: float = 300.0, stop_s: float = 150.0) -> str:
    """Start ``dips launch --run-dir RUN_DIR ARGS``, poll ``until(run_dir)`` every 0.5 s, and
    send SIGINT once it returns None (nothing missing). Returns the launcher's output.

    ``until`` returns a description of what is still missing (or None when all happened);
    the test fails with it if the launcher exits first or ``deadline_s`` passes. ARGS should
    carry a ``--max-time`` longer than ``deadline_s``: the launcher's own safety limit, for
    when this process dies. The launcher is stopped with SIGINT in every case (so it stops its
    children), and killed only if it has not exited ``stop_s`` later.
    """
    log = run_dir.parent / f"{run_dir.name}.launch.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dips.cli", "launch", "--run-dir", str(run_dir), *args],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    missing: str | None = "nothing checked yet"
    try:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline and proc.poll() is None:
            missing = until(run_dir)
            if missing is None:
                break
            time.sleep(0.5)
        early_exit = proc.poll() is not None
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(stop_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    output = log.read_text()
    if missing is not None:
        why = "the launcher exited" if early_exit else f"{deadline_s} s passed"
        raise AssertionError(f"{why} before the awaited events: {missing}\n{output[-3000:]}")
    assert proc.returncode == 0, output[-3000:]
    return output
