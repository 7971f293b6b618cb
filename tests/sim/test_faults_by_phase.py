"""A cluster lost in each phase of its push: the simulator decides as the real leader does.

For each of the four phases a cluster process can be killed in (:mod:`dips.roles.failpoints`:
``window`` admitted, nothing sent; ``push`` mid-push; ``update`` pushed, waiting for the
verdict; ``pull`` verdict in hand, nothing pulled), cluster ``a`` of a two-cluster simulation
fails at its second push (a scheduled :class:`dips.spec.simulate.SimFault`). The simulator
removes it after the missed heartbeats; the leader's phase at that moment is recorded. The
same script then runs on the real :class:`dips.roles.leader.Leader` (its threads, a hand-moved
clock, fake followers, a real ledger): round 1 accepted, round 2 with ``a`` removed by the
monitor's own path in that same phase. Both must decide the same: each cluster's verdict, the
version, and where ``a``'s trained chunk ends (credited to the pushed position, or returned
at its accepted one) and that ``a`` holds nothing afterwards. The rules checked are those of
the real fault tests (tests/roles/test_leader_exactly_once.py: a member removed during the
update is credited, not handed out twice; tests/integration/test_exactly_once.py and
test_faults.py: a fault stays local, the others' round goes on, nothing is counted twice).
"""

from __future__ import annotations

import threading

import pytest

from dips.algo.ledger import ChunkLedger
from dips.roles.leader import FollowerEntry, Leader, LeaderConfig
from dips.sim.engine import Simulation
from dips.spec import MembershipConfig, PenaltyConfig, Timeouts
from tests.roles.test_leader_exactly_once import FakeFollower
from tests.sim.helpers import small
from tests.sim.leader_harness import ManualClock, advance, drop, slots, wait_for

pytestmark = pytest.mark.timeout(60)

WINDOW_S, WPC, TPW, PER_PUSH = 1.0, 40, 129, 8  # grace s, windows per chunk, tokens, per push


def _cluster(cid: str, **extra) -> dict:
    return {"id": cid, "stages": 1, "step_s": 2.0, "windows_per_step": PER_PUSH // 2,
            "uplink": {"bps": 1.0e7}, "recovery_s": 20.0, **extra}


def _scenario(phase: str):
    return small(H=2, penalty={"enabled": False},
                 leader={"grace": {"window_s": WINDOW_S},
                         "membership": {"heartbeat_interval_s": 0.1}},
                 followers={"count": 2, "nic_bps": 1.0e9, "update_s_per_param": 1.0e-5},
                 clusters=[_cluster("a", faults=[{"push": 2, "phase": phase}]), _cluster("b")],
                 norms={"anomaly_prob": 0.0},
                 data={"num_chunks": 8, "windows_per_chunk": WPC, "tokens_per_window": TPW},
                 horizon_s=200)


class Watched(Simulation):
    """A simulation that notes what the comparison needs about ``a``'s second push."""

    def __init__(self, scenario) -> None:
        super().__init__(scenario)
        self.pushed: dict[int, int] = {}   # a's push 2: chunk -> position reported
        self.before: dict[int, int] = {}   # those chunks' accepted positions then
        self.verdicts: dict[str, bool] = {}
        self.version_after = -1
        self.gone_in = ""                  # the leader's phase when a was removed
        self.after: dict | None = None

    def _on_computed(self, t, payload):
        super()._on_computed(t, payload)
        a = self.members["a"]
        if payload[0] == "a" and a.push_no == 2 and not self.pushed:
            self.pushed = {c: p for c, p in self.ledger.pending["a"].items()
                           if p > self.ledger.chunks[c].accepted}
            self.before = {c: self.ledger.chunks[c].accepted for c in self.pushed}

    def _decided(self, decided, t):
        super()._decided(decided, t)
        if any(v.push_id == "a-2" for v in decided.verdicts):
            self.verdicts = {v.cluster_id: v.accepted for v in decided.verdicts}
            self.version_after = self.version
            self._note()

    def _on_gone(self, t, payload):
        if payload[0] == "a" and not self.gone_in and payload[1] == self.members["a"].epoch:
            self.gone_in = self.state.phase.value
        super()._on_gone(t, payload)
        self._note()

    def _note(self) -> None:
        if self.after is None and self.verdicts and self.gone_in:
            self.after = outcome(self.verdicts, self.version_after, self.before, self.pushed,
                                 self.ledger)


def outcome(verdicts: dict[str, bool], version: int, before: dict[int, int],
            pushed: dict[int, int], ledger: ChunkLedger) -> dict:
    """What was decided about round 2, in terms both runs share."""
    now = {c: ledger.chunks[c].accepted for c in pushed}
    return {"verdicts": dict(sorted(verdicts.items())), "version": version,
            "a_windows": "credited" if now == pushed else "returned" if now == before else now,
            "a_holds": [c for c in pushed if ledger.chunks[c].holder == "a"]}


def real(tmp_path, gone_in: str) -> dict:
    """The real leader: round 1 of a and b accepted, then a removed in leader phase
    ``gone_in`` during round 2."""
    clock, fakes = ManualClock(), [FakeFollower(), FakeFollower()]
    cfg = LeaderConfig(followers=2, grace={"window_s": WINDOW_S},
                       membership=MembershipConfig(heartbeat_interval_s=10.0),
                       timeouts=Timeouts(push_s=60, pull_s=60), penalty=PenaltyConfig(enabled=False))
    ledger = ChunkLedger(8, WPC)
    leader = Leader(cfg, connect=lambda e: fakes[e.index], run_dir=tmp_path, ledger=ledger,
                    clock=clock, tokens_per_window=TPW)
    for i in range(2):
        leader.register_follower(FollowerEntry(i, f"tcp://x:{i + 1}", "", [f"l{i}"], [4]))
    leader.start()
    threads: list[threading.Thread] = []
    try:
        wait_for(lambda: leader.ready, "followers reconciled")
        first = {}
        for c in ("a", "b"):
            leader.join_cluster(c, [["l0", "l1"]])
            first[c] = min(c for c, _ in leader.lease(c, 2)[0])

        def done(c: str, grant) -> threading.Thread:
            t = threading.Thread(target=leader.push_done, args=(c, grant.push_id, True, "", 30.0),
                                 daemon=True)
            t.start()
            threads.append(t)
            return t

        for n in (1, 2):
            lost = gone_in if n == 2 else ""
            pushed = {first["a"]: n * PER_PUSH}
            before = {first["a"]: ledger.chunks[first["a"]].accepted}
            grants = {c: leader.request_push(c, leader.version, 1, 10.0,
                                             {first[c]: n * PER_PUSH}) for c in ("a", "b")}
            assert grants["a"].round == grants["b"].round
            if lost == "window":
                drop(leader, "a")
            if lost == "update":
                for f in fakes:
                    f.gate.clear()  # hold the update between scoring and the decision
            reporting = ["b"] if lost in ("window", "push") else ["a", "b"]
            for c in reporting:
                done(c, grants[c])
            wait_for(lambda: all(slots(leader)[c].done for c in reporting), "pushes reported")
            advance(leader, clock, WINDOW_S + 0.01)  # the window closes
            if lost in ("push", "update"):
                wait_for(lambda: leader.phase == lost, f"phase {lost}")
                drop(leader, "a")
                for f in fakes:
                    f.gate.set()
            for t in threads:
                t.join(30)
            wait_for(lambda: leader.phase == "idle", "round ended")
            if lost in ("pull", "idle"):
                drop(leader, "a")
        verdicts = {c: leader._state.verdicts[g.push_id].accepted for c, g in grants.items()}
        return outcome(verdicts, leader.version, before, pushed, ledger)
    finally:
        for f in fakes:
            f.gate.set()
        leader.stop()


#: cluster phase -> (the leader phases its removal may land in, what is decided about round 2)
EXPECTED = {
    "window": (("window", "push"), {"verdicts": {"a": False, "b": True}, "a_windows": "returned"}),
    "push": (("window", "push"), {"verdicts": {"a": False, "b": True}, "a_windows": "returned"}),
    "update": (("update",), {"verdicts": {"a": True, "b": True}, "a_windows": "credited"}),
    "pull": (("pull", "idle"), {"verdicts": {"a": True, "b": True}, "a_windows": "credited"}),
}


@pytest.mark.parametrize("phase", sorted(EXPECTED))
def test_a_cluster_lost_in_each_phase_is_decided_as_by_the_real_leader(tmp_path, phase):
    sim = Watched(_scenario(phase)).run()
    assert sim.counts["scheduled_faults"] == 1 and sim.members["a"].faults == 1
    assert sim.after is not None, "a's second push was never decided"
    phases, decided = EXPECTED[phase]
    assert sim.gone_in in phases
    assert {k: sim.after[k] for k in decided} == decided
    assert sim.after["version"] == 2 and sim.after["a_holds"] == []
    # The real leader, a removed in the same phase of the same round: the same decisions.
    assert real(tmp_path, sim.gone_in) == sim.after
    # And the run went on: a re-joined (pulling the whole model) and pushed again, nothing
    # counted twice, every accepted window in the ledger once.
    a = sim.members["a"]
    assert sim.msgs["JoinCluster"] == 3 and a.push_no > 2 and a.accepted >= 2
    assert sim.version > 4 and not sim.refusals
    sim.ledger.check()
    in_flight = sum(sim._gained.values())  # decided, verdicts not yet out at the horizon
    assert (sim.ledger.accepted_windows - in_flight) * TPW == sim.tokens_accepted
