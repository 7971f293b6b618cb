"""Random (MTBF) follower and leader faults (dips.sim.faults): they happen, they are
carried out by the code of the scheduled ones (detection, readiness, reconciliation, rollback;
the leader's resume), the ledger stays exact, and the run is deterministic."""

from __future__ import annotations

import pytest

from dips.sim import simulate
from dips.sim.engine import Simulation
from dips.sim.faults import RandomFollowerFault, RandomLeaderFault
from tests.sim.helpers import small

pytestmark = pytest.mark.timeout(60)


def _scenario(seed: int = 5, **server):
    follower = {k: v for k, v in server.items() if k.startswith("fault_") or k == "f_mtbf"}
    followers = {"mtbf_s": follower.pop("f_mtbf", None), **follower}
    leader = {"mtbf_s": server.get("l_mtbf"), "restart_s": server.get("restart_s", 4.0)}
    # data for the whole run (no epoch ends; tests/sim/test_ledger_journal.py runs rollbacks
    # across ended epochs)
    return small(seed=seed, followers=followers, leader=leader, data={"num_chunks": 1024})


class Calls(Simulation):
    """Notes the fault handlers called (the scheduled faults' own code paths)."""

    def __init__(self, scenario) -> None:
        super().__init__(scenario)
        self.calls: list[tuple[str, object]] = []

    def _on_follower_fault(self, t, f):
        self.calls.append(("follower_fault", f))
        super()._on_follower_fault(t, f)

    def _on_leader_fault(self, t, lf):
        self.calls.append(("leader_fault", lf))
        super()._on_leader_fault(t, lf)

    def _maybe_reconcile(self, t):
        self.calls.append(("maybe_reconcile", None))
        super()._maybe_reconcile(t)


def test_random_follower_kills_are_detected_reconciled_and_rolled_back():
    sim = Calls(_scenario(f_mtbf=300.0, fault_action="kill", fault_down_s=5.0,
                          fault_checkpoint_lag=1)).run()
    kills = [f for k, f in sim.calls if k == "follower_fault"]
    assert len(kills) == sim.counts["random_follower_faults"] >= 5
    assert all(isinstance(f, RandomFollowerFault) and f.action == "kill" for f in kills)
    kinds = [k for _, k, _ in sim.fault_log]
    # the leader's own path: marked down after its heartbeats, up on registering, reconciled
    assert {"follower_kill", "follower_down", "follower_up", "reconciled"} <= set(kinds)
    assert sim.counts["outer_steps_lost"] > 0  # restarted a checkpoint behind: steps rolled back
    sim.ledger.check()
    pending = sum(sim._gained.values())
    assert (sim.ledger.accepted_windows - pending) * 129 == sim.tokens_accepted
    assert sim.version >= 5  # and the run goes on


def test_random_follower_stops_shorter_than_detection_are_late_heartbeats():
    sim = Calls(_scenario(f_mtbf=200.0, fault_action="stop", fault_down_s=0.5)).run()
    kinds = [k for _, k, _ in sim.fault_log]
    assert kinds.count("follower_stop") == sim.counts["random_follower_faults"] >= 5
    assert "follower_down" not in kinds  # back within the 3 missed heartbeats (3 s)
    assert sim.counts["outer_steps_lost"] == 0


def test_random_leader_crashes_resume_from_what_it_persisted():
    sim = Calls(_scenario(l_mtbf=250.0, restart_s=4.0)).run()
    crashes = [f for k, f in sim.calls if k == "leader_fault"]
    assert len(crashes) == sim.counts["random_leader_faults"] == sim.counts["leader_restarts"] >= 3
    assert all(isinstance(f, RandomLeaderFault) and f.restart_s == 4.0 for f in crashes)
    kinds = [k for _, k, _ in sim.fault_log]
    assert kinds.count("leader_killed") == kinds.count("leader_resumed") == len(crashes)
    sim.ledger.check()
    pending = sum(sim._gained.values())
    assert (sim.ledger.accepted_windows - pending) * 129 == sim.tokens_accepted
    assert sim.version >= 5


def test_random_server_faults_are_deterministic_and_seeded():
    sc = _scenario(f_mtbf=300.0, l_mtbf=400.0, fault_down_s=5.0)
    a, b = simulate(sc), simulate(sc)
    assert a == b
    assert a["server_faults"]["random_follower_faults"] > 0
    assert a["server_faults"]["random_leader_faults"] > 0
    other = simulate(_scenario(seed=6, f_mtbf=300.0, l_mtbf=400.0, fault_down_s=5.0))
    assert other["server_faults"]["events"] != a["server_faults"]["events"]


def test_without_an_mtbf_the_run_is_unchanged():
    plain = simulate(small(data={"num_chunks": 1024}))
    assert simulate(_scenario(seed=3)) == plain  # mtbf None: no draw, nothing scheduled
    assert plain["server_faults"]["random_follower_faults"] == 0


@pytest.mark.parametrize("bad, field", [
    ({"followers": {"mtbf_s": 0}}, "mtbf_s"),
    ({"followers": {"fault_down_s": -1.0}}, "fault_down_s"),
    ({"followers": {"fault_action": "pause"}}, "fault_action"),
    ({"leader": {"mtbf_s": -5.0}}, "mtbf_s"),
    ({"leader": {"restart_s": 0}}, "restart_s")])
def test_bad_random_fault_settings_name_their_field(bad, field):
    with pytest.raises(ValueError, match=field):
        small(**bad)
