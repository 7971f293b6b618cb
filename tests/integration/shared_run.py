"""One fault-free `dips launch` shared by two tests that each check a different property of it
(the fixture ``quiet_run`` of test_quiet_run.py): the run is the expensive part (most of a minute
of process start-up and shut-down on 2 cores), the checks are cheap.

- exactly once (issue 10), input 2 (a slow link sends its push ahead): configs/tiny.yaml with
  cluster c uploading at 40 kbit/s (a push takes ~14 s) against a round push timeout of 6 s;
- SIGINT on `dips launch` and one leader at a time (issue 11): once an outer step is
  accepted, a second leader started from a copy of the live leader's state steps down
  without changing a follower, the live leader goes on making outer steps, and the run is
  stopped with SIGINT. Neither depends on c's link.

The run lasts until every event the two tests are about has happened (runner.launch_until:
the second leader exited and an outer step followed, two pushes of c delivered ahead of their
round, 10 versions applied), however long that takes on a loaded machine; then SIGINT.
``--max-time`` is only a safety limit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.integration.invariants import effective_history
from tests.integration.runner import ROOT, jsonl_so_far, launch_until


@dataclass
class SharedRun:
    run_dir: Path
    output: str  # the launcher's stdout and stderr
    second_leader: dict  # what the second leader's check saw (see second_leader_steps_down)


def config() -> dict:
    """configs/tiny.yaml with cluster c on a 40 kbit/s link and the round push timeout at 6 s."""
    cfg = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())
    cfg["clusters"] = [{"id": "a", "slowdown": 1.0}, {"id": "b", "slowdown": 1.5, "stages": 2},
                       {"id": "c", "slowdown": 1.0, "link": {"bps": 40000}}]
    cfg["timeouts"]["push_s"] = 6
    return cfg


def accepted_steps(run_dir: Path) -> int:
    """Outer steps (rounds with an accepted update) the leader has logged so far."""
    return sum(1 for r in jsonl_so_far(run_dir / "outer_steps.jsonl") if r.get("accepted"))


def applied(run_dir: Path) -> int:
    return min(len(effective_history(jsonl_so_far(run_dir / "followers" / str(i) / "applied.jsonl")))
               for i in range(2))


def decisions(run_dir: Path) -> list[dict]:
    return [r for r in jsonl_so_far(run_dir / "outer_steps.jsonl") if "event" not in r]


def second_leader_steps_down(run_dir: Path, tmp_path: Path) -> dict:
    """A copy of the live leader's state directory started as a leader on another port: it
    should take term + 1, find the followers leased to the live leader, and exit with code 3
    without having changed a follower. Returns what it saw (test_interrupt.py asserts it)."""
    from dips.algo.fencing import starts_of
    from dips.emu.launcher import free_port

    copy = tmp_path / "leader-copy"
    copy.mkdir()
    for name in ("run.json", "term", "data_secret", "leader.json", "config.json"):
        shutil.copy2(run_dir / name, copy / name)
    live_starts = int((run_dir / "term").read_text())  # the leader's start count
    terms = [int((f / "leader_term").read_text()) for f in (run_dir / "followers").iterdir()]
    second = subprocess.run(
        [sys.executable, "-m", "dips.cli", "leader", "--config", str(copy / "config.json"),
         "--listen", f"127.0.0.1:{free_port()}", "--state-dir", str(copy),
         "--tls", str(run_dir / "pki" / "leader")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, HF_HUB_OFFLINE="1"))
    after = [int((f / "leader_term").read_text()) for f in (run_dir / "followers").iterdir()]
    return {"live_starts": live_starts, "follower_starts": [starts_of(t) for t in terms],
            "returncode": second.returncode, "stderr": second.stderr,
            "copy_term": int((copy / "term").read_text()), "terms_before": terms,
            "terms_after": after, "steps_at_exit": accepted_steps(run_dir)}


def run(tmp_path: Path) -> SharedRun:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config()))
    run_dir = tmp_path / "run"
    second: dict = {}

    def missing(run_dir: Path) -> str | None:
        if not second:
            if not accepted_steps(run_dir):
                return "no outer step yet (the second leader starts after the first)"
            # The launcher and its run go on meanwhile; this waits for the second leader's exit.
            second.update(second_leader_steps_down(run_dir, tmp_path))
        if accepted_steps(run_dir) <= second["steps_at_exit"]:
            return "no outer step of the live leader since the second leader exited"
        ahead = [r for r in decisions(run_dir) if "c" in r.get("ahead", []) and "c" in r["scored"]]
        if len(ahead) < 2:
            return f"{len(ahead)} of 2 pushes of c delivered ahead of their round"
        return None if applied(run_dir) >= 10 else "fewer than 10 versions applied"

    output = launch_until(["--config", str(path), "--max-time", "600"], run_dir, missing,
                          deadline_s=360)
    return SharedRun(run_dir, output, second)
