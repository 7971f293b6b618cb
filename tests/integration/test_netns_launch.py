"""`dips launch` with `network: netns` (root): every cluster in its own network namespace,
joined by veth to the servers' namespace, its link shaped by tc tbf, and a cut link that is a
real veth going down (issue 3 real-time shaping, issue 4 fault injection).

The run lasts until the cut was noticed (cluster removed), healed (cluster re-joined) and an
outer step was accepted after that, with 12 versions applied in all (runner.launch_until);
``--max-time`` is only a safety limit. The cut lasts 6 s, four times the 1.5 s after which
the leader notices a silent cluster.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.integration.invariants import check_run, effective_history, jsonl
from tests.integration.runner import ROOT, jsonl_so_far, launch_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _netns_ok() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    from dips.emu.netns import probe

    cap = probe()
    return None if cap.shaping == "tc-tbf" else f"network namespaces unavailable: {cap}"


def _cut_and_healed(run_dir: Path) -> str | None:
    """What is still missing before the run may stop (None: nothing)."""
    cut = [e for e in jsonl_so_far(run_dir / "events.jsonl")
           if e["event"] == "fault" and e.get("action") == "cut_link"]
    if not cut:
        return "the link has not been cut"
    lead = jsonl_so_far(run_dir / "leader_events.jsonl")
    seen = {}
    for kind in ("cluster_removed", "cluster_joined"):
        found = [e for e in lead if e["event"] == kind and e["cluster"] == "a"
                 and e["time"] > cut[0]["time"]]
        if not found:
            return f"no {kind} of cluster a after the cut"
        seen[kind] = found[0]["time"]
    if not [r for r in jsonl_so_far(run_dir / "outer_steps.jsonl") if r.get("accepted")
            and not r.get("error") and r.get("time", 0) > seen["cluster_joined"]]:
        return "no outer step accepted after cluster a re-joined"
    applied = min(len(effective_history(jsonl_so_far(run_dir / "followers" / str(i) /
                                                     "applied.jsonl"))) for i in range(2))
    return None if applied >= 12 else f"{applied} of 12 versions applied"


def test_clusters_in_namespaces_survive_a_kernel_link_cut(tmp_path):
    why = _netns_ok()
    if why:
        pytest.skip(why)
    cfg = (ROOT / "configs/tiny.yaml").read_text()
    cfg = cfg.replace("followers: 2", "followers: 2\nnetwork: netns")
    cfg = cfg.replace("- {id: a, slowdown: 1.0}", "- {id: a, slowdown: 1.0, link: {bps: 200000000}}")
    (tmp_path / "cfg.yaml").write_text(cfg)
    (tmp_path / "faults.yaml").write_text(
        "faults:\n  - {at_s: 14, action: cut_link, target: cluster-a, duration_s: 6}\n")
    run_dir = tmp_path / "run"
    launch_until(["--config", str(tmp_path / "cfg.yaml"), "--max-time", "600",
                  "--faults", str(tmp_path / "faults.yaml")], run_dir, _cut_and_healed)
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
