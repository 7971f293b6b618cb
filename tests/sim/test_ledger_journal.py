"""The simulated leader's ledger checkpoint in O(changes) (dips.sim.ledger_journal, issue 16):
equal to the full copy ``to_dict()`` after any sequence of transitions, and a run with
random leader crashes (and follower kills that roll steps back, across data epochs) gives the
same ``simulate.json`` and the same ledger as the same run checkpointing by the full copy."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dips.algo.ledger import ChunkLedger
from dips.sim import simulate
from dips.sim.engine import Simulation
from dips.sim.ledger_journal import JournaledLedger
from tests.sim.helpers import small

pytestmark = pytest.mark.timeout(120)

OPS = st.lists(st.tuples(
    st.sampled_from(["lease"] * 3 + ["report"] * 3 + ["step"] * 3 +
                    ["release", "rollback", "checkpoint", "checkpoint", "restore"]),
    st.sampled_from(["a", "b", "c"]), st.integers(0, 7)), min_size=20, max_size=80)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 4), w=st.integers(1, 3), ops=OPS)
def test_checkpoint_equals_the_full_copy_after_any_transitions(n, w, ops):
    led, version, saved = JournaledLedger(n, w, keep_history=4), 0, None
    for op, cid, k in ops:
        if op == "lease":
            led.lease(cid, 1 + k % 3)
        elif op == "report" and led.holdings(cid):
            led.report(cid, {c: w if k >= 3 else a + k % (w - a + 1)
                             for c, a in led.holdings(cid)})
        elif op == "step":
            version += 1
            for i, c in enumerate(sorted(led.pending)):
                led.resolve(c, bool(k >> i & 1), version)
        elif op == "release":
            led.release(cid)
        elif op == "rollback":
            version = max(0, version - k % 4)
            led.rollback(version)
        elif op == "checkpoint":
            saved = led.checkpoint()
            assert saved == led.to_dict()
            assert json.dumps(saved) == json.dumps(led.to_dict())  # the same order too
        elif op == "restore" and saved is not None:  # as the simulated leader's resume
            led = JournaledLedger.from_dict(saved)
            led.pending.clear()
            assert led.checkpoint() == led.to_dict()
    assert led.checkpoint() == led.to_dict()


def _faulty(chunks: int):
    return small(seed=11, followers={"mtbf_s": 250.0, "fault_action": "kill",
                                     "fault_down_s": 5.0, "fault_checkpoint_lag": 1},
                 leader={"mtbf_s": 300.0, "restart_s": 4.0},
                 data={"num_chunks": chunks}, horizon_s=3000)


def _run(sc):
    sim = Simulation(sc).run()
    return sim, json.dumps(simulate(sc, plots=False), sort_keys=True, default=str)


@pytest.mark.parametrize("chunks", [16, 1024])  # epochs ending often, and none ending
def test_a_run_with_leader_crashes_is_the_same_as_with_the_full_copy(monkeypatch, chunks):
    sc = _faulty(chunks)
    sim, doc = _run(sc)
    assert sim.counts["random_leader_faults"] >= 3 and sim.counts["outer_steps_lost"] > 0
    if chunks == 16:
        assert sim.ledger.epoch >= 2
    with monkeypatch.context() as m:  # the reference: the checkpoint as a full copy
        m.setattr(JournaledLedger, "checkpoint", ChunkLedger.to_dict)
        ref, ref_doc = _run(sc)
    assert doc == ref_doc
    assert sim.ledger.to_dict() == ref.ledger.to_dict()
    assert sim.persisted == ref.persisted
    sim.ledger.check()
    # every window the ledger counts is in the tokens accepted, across epochs and rollbacks
    pending = sum(sim._gained.values())
    assert (sim.ledger.accepted_windows - pending) * 129 == sim.tokens_accepted
