"""Fault injection as real processes (§12, §16 of the seed): one run per fault kind.

After each fault the run goes on, the validation loss keeps falling, and DESIGN.md's
invariants hold (see invariants.py): all followers applied the same accepted sets and clip
factors, shards and checkpoints carry the same version, no accepted update is applied twice or
lost, and the ledger accounts for every accepted window exactly once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.invariants import check_run, jsonl

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

FAULTS = {
    "kill-leader": "- {at_s: 14, action: kill, target: leader}",
    "kill-follower-in-update": "- {phase: update, after_s: 14, action: kill, target: follower-1}",
    "kill-cluster-in-push": "- {phase: push, after_s: 14, action: kill, target: cluster-c}",
    "hang-follower": "- {at_s: 14, action: stop, target: follower-0, duration_s: 3}",
    "cut-link": "- {at_s: 14, action: cut_link, target: cluster-a, duration_s: 3}",
}


def _launch(tmp_path: Path, fault: str) -> Path:
    plan = tmp_path / "faults.yaml"
    plan.write_text("faults:\n  " + fault + "\n")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "dips.cli", "launch", "--config", str(ROOT / "configs/tiny.yaml"),
         "--run-dir", str(run_dir), "--max-time", "40", "--faults", str(plan)],
        cwd=ROOT, capture_output=True, text=True, timeout=380,
        env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir


def _after(events: list[dict], t: float, kind: str, **match) -> list[dict]:
    return [e for e in events if e["time"] >= t and e["event"] == kind
            and all(e.get(k) == v for k, v in match.items())]


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_fault_stays_local_and_invariants_hold(tmp_path, name):
    run_dir = _launch(tmp_path, FAULTS[name])
    figures = check_run(run_dir)
    events = jsonl(run_dir / "events.jsonl")
    leader_events = jsonl(run_dir / "leader_events.jsonl")
    fault = [e for e in events if e["event"] == "fault"]
    assert fault, f"the fault never fired: {events}"
    t = fault[0].get("fired_at", fault[0]["time"])
    steps = [r for r in jsonl(run_dir / "outer_steps.jsonl")
             if r.get("accepted") and r.get("time", 0) > t]
    assert steps, "no outer step completed after the fault"
    if name == "kill-leader":
        assert _after(events, t, "restart", process="leader")
        assert _after(leader_events, t, "leader_resumed")
    elif name == "kill-follower-in-update":
        assert _after(events, t, "restart", process="follower-1")
        assert _after(leader_events, t, "reconciled")
    elif name == "kill-cluster-in-push":
        assert _after(events, t, "restart", process="cluster-c")
        assert _after(leader_events, t, "cluster_joined", cluster="c")
    elif name == "hang-follower":
        assert _after(leader_events, t, "follower_down", follower=0)
        assert _after(leader_events, t, "follower_up", follower=0)
    elif name == "cut-link":
        assert _after(leader_events, t, "cluster_removed", cluster="a")
        assert _after(leader_events, t, "cluster_joined", cluster="a")
    # The other clusters kept training through the fault (no global pause).
    assert figures["summary"]["tokens_consumed"] > 0
