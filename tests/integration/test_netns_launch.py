"""`dips launch` with `network: netns` (root): every cluster in its own network namespace,
joined by veth to the servers' namespace, its link shaped by tc tbf, and a cut link that is a
real veth going down (issue 3 real-time shaping, issue 4 fault injection)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.invariants import check_run, jsonl

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


def _netns_ok() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    from dips.emu.netns import probe

    cap = probe()
    return None if cap.shaping == "tc-tbf" else f"network namespaces unavailable: {cap}"


def test_clusters_in_namespaces_survive_a_kernel_link_cut(tmp_path):
    why = _netns_ok()
    if why:
        pytest.skip(why)
    cfg = (ROOT / "configs/tiny.yaml").read_text()
    cfg = cfg.replace("followers: 2", "followers: 2\nnetwork: netns")
    cfg = cfg.replace("- {id: a, slowdown: 1.0}", "- {id: a, slowdown: 1.0, link_bps: 200000000}")
    (tmp_path / "cfg.yaml").write_text(cfg)
    (tmp_path / "faults.yaml").write_text(
        "faults:\n  - {at_s: 14, action: cut_link, target: cluster-a, duration_s: 3}\n")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "dips.cli", "launch", "--config", str(tmp_path / "cfg.yaml"),
         "--run-dir", str(run_dir), "--max-time", "35", "--faults", str(tmp_path / "faults.yaml")],
        cwd=ROOT, capture_output=True, text=True, timeout=380,
        env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_run(run_dir)
    events = jsonl(run_dir / "events.jsonl")
    net = [e for e in events if e["event"] == "network"]
    assert net and net[0]["mode"] == "netns"
    cut = [e for e in events if e["event"] == "fault" and e.get("action") == "cut_link"]
    assert cut and cut[0]["how"] == "netns"
    lead = jsonl(run_dir / "leader_events.jsonl")
    t = cut[0]["time"]
    assert [e for e in lead if e["event"] == "cluster_removed" and e["cluster"] == "a"
            and e["time"] > t]
    assert [e for e in lead if e["event"] == "cluster_joined" and e["cluster"] == "a"
            and e["time"] > t]
    # The run removed every namespace it created.
    from dips.emu.netns import list_namespaces

    assert list_namespaces(net[0]["prefix"]) == []
