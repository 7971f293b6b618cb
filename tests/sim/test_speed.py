"""The engine's speed-ups (SCALE.md "Engine speed") change no figure they should not:
identical concurrent pulls carried as one weighted flow set, a NIC's completion event kept while
its allocation is unchanged, and a stage worker's back-to-back layers to one follower sent as
one flow (started after the setups of its transfers, so its push takes as long)."""

from __future__ import annotations

import json

import pytest

from dips.sim import network
from dips.sim.engine import Simulation
from dips.sim.report import summarize
from tests.sim.helpers import small


def _many(**extra):
    """Twelve clusters of two types (identical pulls after a shared verdict), faults on one
    type so some leave a merged pull midway, a follower stopped in a pull."""
    return small(**{
        "clusters": [
            {"id": "a", "count": 8, "stages": 2, "step_s": 2.0, "step_cv": 0.05,
             "windows_per_step": 8, "uplink": {"bps": 1.0e8}, "latency_s": 0.01,
             "mtbf_s": 400.0, "recovery_s": 60.0},
            {"id": "b", "count": 4, "stages": 3, "step_s": 2.5, "windows_per_step": 8,
             "uplink": {"bps": 2.0e8}, "downlink": {"bps": 3.0e8}}],
        "followers": {"faults": [{"follower": 1, "round": 3, "phase": "pull",
                                  "action": "stop", "down_s": 1.5}]},
        "data": {"num_chunks": 256}, **extra})


def _run(sc, monkeypatch, **flags):
    for name, value in flags.items():
        monkeypatch.setattr(network, name, value)
    sim = Simulation(sc).run()
    return sim, json.dumps(summarize(sim), sort_keys=True)


def test_merged_pulls_give_the_same_run(monkeypatch):
    sc = _many()
    merged, doc = _run(sc, monkeypatch, MERGE_JOBS=True)
    alone, doc_alone = _run(sc, monkeypatch, MERGE_JOBS=False)
    assert merged.net.merged > 20 and alone.net.merged == 0
    assert merged.net._next_id < alone.net._next_id  # fewer flows
    assert sum(m.faults for m in merged.members.values()) > 3  # some left a merged pull
    assert doc == doc_alone


def test_kept_completion_events_give_the_same_run(monkeypatch):
    sc = _many()
    kept, doc = _run(sc, monkeypatch, KEEP_PENDING=True)
    pushed, doc_pushed = _run(sc, monkeypatch, KEEP_PENDING=False)
    assert kept.q._seq < pushed.q._seq  # fewer events
    assert doc == doc_pushed


def test_back_to_back_layers_to_one_follower_are_one_flow():
    sc = small(followers={"count": 1},
               clusters=[{"id": "a", "stages": 1, "step_s": 2.0, "windows_per_step": 8,
                          "uplink": {"bps": 1.0e8}, "latency_s": 0.5, "initial_pull": False}],
               horizon_s=40)
    sim = Simulation(sc)
    m = sim.members["a"]
    launched, launch = [], sim.net.launch
    sim.net.launch = lambda t, job, *a: launched.append(job.direction) or launch(t, job, *a)
    sim.run()
    layers = len(m.stage_layers[0])
    assert layers > 2
    nbytes = sum(sim.layer_bytes)
    # one flow: the setups of its transfers first, then the whole model at the link's rate
    assert m.push_s[0] == pytest.approx(0.5 * layers + 8 * nbytes / 1.0e8, rel=1e-9)
    assert launched[:2] == ["in", "out"]  # the first push is one flow, then its pull
