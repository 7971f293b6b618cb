"""`dips launch` with stdout not a terminal (issue 15): a log that reads well in a file.

A real run of the tiny config (3 clusters, 2 followers) with stdout captured: no table is
drawn (no box-drawing character anywhere), there is exactly one line per round the leader
decided in ``outer_steps.jsonl`` (same versions, same accepted sets), and the log grows by
less than 5 KB per minute of training. The grace window is widened to 3 s: rounds are
sequential and each lasts at least its window, so on any machine at most 20 rounds — and
lines — come a minute (the demo makes ~10); the bytes per line are checked on their own.
The run stops on an event (``--max-outer-steps``), never after a duration.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(480)]
OUTER_STEPS = 12
BOX = re.compile("[\u2500-\u259f]")  # box drawing and block elements: rich's tables
STEP = re.compile(r"^\[ *\d+ s\] (?:outer step v(\d+) \(round (\d+)\): accepted ([^;]+)|"
                  r"round (\d+): nothing applied)")


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _kill_leftovers(run_dir: Path) -> None:
    """SIGKILL any process the launcher started that still runs (only if the launcher itself
    had to be killed): by pid from events.jsonl, checked against its command line."""
    for e in _jsonl(run_dir / "events.jsonl"):
        if e.get("event") not in ("start", "restart"):
            continue
        try:
            cmd = Path(f"/proc/{e['pid']}/cmdline").read_bytes()
        except OSError:
            continue
        if str(run_dir).encode() in cmd:
            try:
                os.kill(e["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, bytes, bytes]:
    tmp = tmp_path_factory.mktemp("launch_log")
    cfg = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())
    cfg["grace"] = {**cfg.get("grace", {}), "window_s": 3.0}
    config = tmp / "tiny-log.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run_dir = tmp / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dips.cli", "launch", "--config", str(config), "--run-dir",
         str(run_dir), "--max-outer-steps", str(OUTER_STEPS), "--max-time", "300"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        out, err = proc.communicate(timeout=440)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the launcher stops its children in order
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_leftovers(run_dir)
    assert proc.returncode == 0, (out[-3000:] + err[-3000:]).decode(errors="replace")
    stops = [e for e in _jsonl(run_dir / "events.jsonl") if e["event"] == "stop"]
    assert [e["reason"] for e in stops] == ["max outer steps"], stops
    return run_dir, out, err


def test_no_table_is_drawn(launched):
    _, out, err = launched
    text = out.decode()
    assert not BOX.search(text) and not BOX.search(err.decode(errors="replace"))
    assert "\x1b[" not in text  # no cursor movement or colour codes either


def test_one_line_per_decided_round(launched):
    run_dir, out, _ = launched
    decided = [r for r in _jsonl(run_dir / "outer_steps.jsonl") if "event" not in r]
    assert len(decided) >= OUTER_STEPS
    lines = [m for m in map(STEP.match, out.decode().splitlines()) if m]
    assert len(lines) == len(decided)
    for m, rec in zip(lines, decided):
        if rec["accepted"]:
            assert (int(m[1]), int(m[2])) == (rec["version"], rec["round"])
            assert m[3].split(", ") == rec["accepted"]
        else:
            assert int(m[4]) == rec["round"]


def test_log_grows_by_events_not_by_time(launched):
    run_dir, out, _ = launched
    events = _jsonl(run_dir / "events.jsonl")
    start = float((run_dir / "train_start").read_text())
    stop = next(e["time"] for e in events if e["event"] == "stop")
    minutes = (stop - start) / 60
    lines = out.decode().splitlines()
    steps = [ln for ln in lines if STEP.match(ln)]
    assert max(len(ln) for ln in steps) <= 160
    assert len(lines) - len(steps) <= 20  # header, stop, summary: a constant, not per second
    assert len(out) / minutes < 5 * 1024, (len(out), minutes)


def test_every_process_was_given_a_metrics_endpoint(launched):
    """`dips launch` passes --metrics-port to each process it starts and says where in
    metrics.json (the endpoints themselves are scraped in tests/node/test_metrics_run.py)."""
    run_dir, _, _ = launched
    targets = json.loads((run_dir / "metrics.json").read_text())
    started = {e["process"] for e in _jsonl(run_dir / "events.jsonl") if e.get("event") == "start"}
    assert started and started <= set(targets)
    ports = [int(t.rsplit(":", 1)[1]) for t in targets.values()]
    assert len(set(ports)) == len(ports) and all(0 < p < 65536 for p in ports)
