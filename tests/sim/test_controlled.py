"""The run behind the seed's §5 leader message figures (configs/simulate/controlled-16-1b.yaml:
§13's 16 real clusters, LLaMA3.2-1B, one follower; SCALE.md "The §5 run"). Six simulated
hours instead of three days. Nothing in the scenario is fitted to §5's 1.35 / 26 msg/s: the
checks pin what the simulated rate is made of, not that it matches."""

from __future__ import annotations

from pathlib import Path

import pytest

from dips.sim import simulate
from dips.spec.simulate import load_sim_scenario

pytestmark = pytest.mark.timeout(120)
SCENARIO = Path(__file__).resolve().parents[2] / "configs" / "simulate" / "controlled-16-1b.yaml"


@pytest.fixture(scope="module")
def doc():
    s = load_sim_scenario(SCENARIO)
    return simulate(s.model_copy(update={"horizon_s": 6 * 3600.0}))


def test_the_scenario_is_the_seeds_platform(doc):
    sc = load_sim_scenario(SCENARIO)
    assert sum(c.count for c in sc.clusters) == 16 and sc.followers.count == 1  # §12, §13
    assert sc.H == 64 and doc["model"]["params"] == 1_235_814_400  # LLaMA3.2-1B
    assert sc.horizon_s == 3 * 86400  # §5: 3 days
    steps = sorted(c.step_s for c in sc.clusters)
    assert steps[-1] / steps[0] == pytest.approx(6.96, abs=0.01)  # the seed: up to 8.18x


def test_the_leader_messages_are_heartbeats_and_each_push_and_round(doc):
    lead, kinds = doc["leader"], doc["leader"]["by_kind"]
    # 16 clusters + 1 follower beating every 30.4 s (§12's 1.52-min detection / 3)
    assert lead["heartbeat_rate"] == pytest.approx(17 / 30.4, rel=0.01)
    # per push RequestPush, PushDone, PullDone; per round the one follower's 4 replies
    steps = doc["rounds"]["outer_steps"]
    assert kinds["Score"] - kinds.get("Discard", 0) <= kinds["Aggregate"] == kinds["Apply"] == steps
    other = lead["msg_rate_avg"] - lead["heartbeat_rate"]
    per_s = (3 * doc["pushes"]["decided"] + 4 * steps) / doc["simulated_s"]
    assert other == pytest.approx(per_s, rel=0.05)
    # the start: 16 x (GetSpec, JoinCluster, Lease), the follower registering, its first
    # reconciliation (GetState, Restore, Abort)
    assert (lead["msg_rate_peak_at_s"], lead["msg_rate_peak"]) == (0, 3 * 16 + 1 + 3)
    ref = doc["reference"]["figures"]
    assert ref["leader_msg_rate_avg"]["paper"] == 1.35 and ref["leader_msg_rate_peak"]["paper"] == 26
