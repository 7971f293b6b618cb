"""A cluster's re-join is recorded as one (review 15, #9): ``cluster_joined`` carries
``rejoin: true`` whenever the id joined the run before — still a member (its process restarted
before the leader noticed), removed or gone in between, or before a restart of the leader
(``leader.json`` keeps the ids) — so the launcher prints its line (``dips.emu.progress``;
end to end in tests/integration/test_faults.py)."""

from __future__ import annotations

import json

import pytest

from tests.roles.test_hostile_leader import make_leader

pytestmark = pytest.mark.timeout(60)

STAGES = [["l0", "l1"]]


def joins(run_dir) -> list[tuple[str, bool]]:
    recs = [json.loads(line) for line in (run_dir / "leader_events.jsonl").read_text().splitlines()]
    return [(r["cluster"], r["rejoin"]) for r in recs if r["event"] == "cluster_joined"]


def test_a_re_join_is_one_after_a_fast_restart_a_removal_and_a_leader_restart(tmp_path):
    leader, _ = make_leader(tmp_path)
    try:
        leader.join_cluster("a", STAGES)
        leader.join_cluster("a", STAGES)  # its process restarted while still a member
        leader.leave("a")                  # no longer a member (as after a removal)
        leader.join_cluster("a", STAGES)
        leader.join_cluster("b", STAGES)
        leader.leave("b")
    finally:
        leader.stop()
    again, _ = make_leader(tmp_path)       # the leader restarted from leader.json
    try:
        again.join_cluster("b", STAGES)   # gone before the restart, back after it
        again.join_cluster("c", STAGES)
    finally:
        again.stop()
    assert joins(tmp_path) == [("a", False), ("a", True), ("a", True), ("b", False),
                               ("b", True), ("c", False)]

