"""The simulator: deterministic, and driven by the leader's real decision code (issue 16)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

import dips.algo.round as round_machine
import dips.roles.outer_step as outer_step
from dips.algo.ledger import ChunkLedger
from dips.sim import simulate
from dips.sim.engine import Simulation
from tests.sim.helpers import small

pytestmark = pytest.mark.timeout(60)


def test_same_seed_same_output_bit_for_bit(tmp_path):
    simulate(small(horizon_s=1000), tmp_path / "one", plots=False)
    simulate(small(horizon_s=1000), tmp_path / "two", plots=False)
    one = (tmp_path / "one" / "simulate.json").read_bytes()
    assert one == (tmp_path / "two" / "simulate.json").read_bytes()
    other = simulate(small(seed=4, horizon_s=1000), None)
    assert json.loads(one)["clusters"] != other["clusters"]


def test_the_real_decision_functions_decide(monkeypatch):
    """Recording wrappers around the round machine, the §8 penalty, the ledger and the §10
    schedule: every one of them is called, and what the simulator reports is what they said."""
    calls: Counter[str] = Counter()
    events: list[str] = []
    verdicts: list[tuple[list[str], list[str]]] = []
    real_step, real_decide = round_machine.step, outer_step.decide
    real_resolve = ChunkLedger.resolve

    def step(state, event, policy):
        events.append(type(event).__name__)
        return real_step(state, event, policy)

    def decide(state, sq_norms, cfg, bound=None):
        verdict, new = real_decide(state, sq_norms, cfg, bound)
        verdicts.append((verdict.accepted, verdict.rejected))
        return verdict, new

    def resolve(self, cluster, accepted, version=None):
        calls["resolve"] += 1
        return real_resolve(self, cluster, accepted, version)

    monkeypatch.setattr(round_machine, "step", step)
    monkeypatch.setattr(outer_step, "decide", decide)
    monkeypatch.setattr(ChunkLedger, "resolve", resolve)
    sim = Simulation(small()).run()
    kinds = Counter(events)
    assert kinds["PushRequested"] == sum(m.push_no for m in sim.members.values()) > 10
    assert kinds["UpdateFinished"] == sim.counts["rounds_ended"] + (sim.state.phase.value == "pull")
    assert {"Tick", "PushReported", "PullDone"} <= kinds.keys()
    assert len(verdicts) == sim.round_sizes.total() and sim.version > 0
    accepted = sum(len(a) for a, _ in verdicts)
    rejected = sum(len(r) for _, r in verdicts)
    assert (accepted, rejected) == (sim.counts["accepted"], sim.counts["rejected"])
    assert rejected > 0  # anomaly_prob 0.1: the penalty rejects some corrupted pushes
    assert calls["resolve"] == sim.counts["pushes"]
    sim.ledger.check()


def test_faults_remove_and_readmit_clusters():
    s = small(clusters=[{"id": "f", "count": 2, "stages": 2, "step_s": 2.0, "windows_per_step": 8,
                         "uplink": {"bps": 1.0e8}, "mtbf_s": 150, "recovery_s": 20}])
    sim = Simulation(s).run()
    faults = sum(m.faults for m in sim.members.values())
    assert faults >= 3
    assert sim.msgs["JoinCluster"] == 2 + faults  # every failed cluster came back
    assert sim.version > 20 and not sim.refusals
    for m in sim.members.values():
        assert m.totals["down"] > 0 if m.faults else "down" not in m.totals
    sim.ledger.check()


def test_link_schedules_and_nic_sharing_shape_transfers():
    """Cluster b's uplink drops to a quarter at 500 s: its pushes take longer after it; a NIC
    of 1e8 bits/s shared by everyone caps every follower's rate."""
    sim = Simulation(small()).run()
    b = sim.members["b"]
    assert max(b.push_s) > 2 * min(b.push_s)
    narrow = Simulation(small(followers={"nic_bps": 1.0e8})).run()
    assert max(ld.peak_bps["in"] for ld in narrow.loads) <= 1.0e8 * (1 + 1e-9)
    assert sum(narrow.members["a1"].push_s) / len(narrow.members["a1"].push_s) > \
        sum(sim.members["a1"].push_s) / len(sim.members["a1"].push_s)
