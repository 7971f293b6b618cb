"""A follower down or restarted, and a leader restarted: the simulator decides as the real leader.

Each case runs a two-cluster simulation with one scheduled fault
(:class:`dips.spec.simulate.SimFollowerFault`, :class:`~dips.spec.simulate.SimLeaderFault`)
and the same script on the real :class:`dips.roles.leader.Leader` (its threads, a hand-moved
clock, fake followers, a real ledger), and compares what was decided, in terms both share: each
push's verdict, the version, what the reconciliation chose and lost, the ledger's accepted
windows. The cases are those of the real fault tests:

* a follower stopped while the clusters push to it: the round ends at once, every push failed
  with ``"follower 1 down"``, nothing counted (tests/roles/test_leader_exactly_once.py
  ``test_a_follower_lost_mid_round_ends_it_at_once``; tests/integration/test_faults.py's hang);
* a follower killed inside its update, restarted from a checkpoint one version behind: the
  round fails, the followers are reconciled one version back, its windows handed out again
  (test_faults.py's kill-follower-in-update, tests/integration/test_exactly_once.py);
* the leader killed after its decision, before any commit: the restarted leader rolls the step
  forward and re-serves its verdicts, nothing counted twice (test_leader_exactly_once.py
  ``test_a_leader_dead_between_its_decision_and_the_commits_re_serves_the_verdict``,
  test_exactly_once.py's leader kill);
* the leader killed in the push phase: the restarted leader does not know the pushes
  (``UNKNOWN_PUSH``), the clusters re-join, nothing is counted.
"""

from __future__ import annotations

import random
import threading

import pytest

from dips.algo.ledger import ChunkLedger
from dips.algo.refusal import Refused
from dips.roles.leader import FollowerEntry, Leader, LeaderConfig
from dips.sim import simulate
from dips.sim.engine import Simulation
from dips.spec import MembershipConfig, PenaltyConfig, Timeouts
from tests.roles.test_leader_exactly_once import FakeFollower
from tests.sim.helpers import small
from tests.sim.leader_harness import ManualClock, advance, slots, wait_for
from tests.sim.recording import Trace, install

pytestmark = pytest.mark.timeout(60)

WINDOW_S, WPC, TPW, PER_PUSH = 1.0, 40, 129, 8  # grace s, windows per chunk, tokens, per push


def _scenario(followers=(), leader=(), seed: int = 3):
    clusters = [{"id": c, "stages": 1, "step_s": 2.0, "windows_per_step": PER_PUSH // 2,
                 "uplink": {"bps": 1.0e7}} for c in ("a", "b")]
    return small(H=2, seed=seed, penalty={"enabled": False},
                 leader={"grace": {"window_s": WINDOW_S}, "faults": list(leader),
                         "membership": {"heartbeat_interval_s": 0.1}},
                 followers={"count": 2, "nic_bps": 1.0e9, "update_s_per_param": 1.0e-5,
                            "faults": list(followers)},
                 clusters=clusters, norms={"anomaly_prob": 0.0},
                 data={"num_chunks": 8, "windows_per_chunk": WPC, "tokens_per_window": TPW},
                 horizon_s=120)


class Watched(Simulation):
    """Notes every verdict (first time out, or re-served) and the state at each
    reconciliation."""

    def __init__(self, scenario) -> None:
        super().__init__(scenario)
        self.verdicts: dict[str, tuple] = {}
        self.reconciled: list[dict] = []

    def _verdict(self, v, t):
        self.verdicts.setdefault(v.push_id, (v.accepted, v.version, v.reason))
        super()._verdict(v, t)

    def _maybe_reconcile(self, t):
        before = len(self.fault_log)
        super()._maybe_reconcile(t)
        if len(self.fault_log) > before and self.fault_log[-1][1] == "reconciled":
            self.reconciled.append({**self.fault_log[-1][2], "windows": self.ledger.accepted_windows,
                                    "followers": [f.version for _, f in self.followers]})


class Fake(FakeFollower):
    """A fake follower that can die (every call fails) and keeps its checkpoints."""

    def __init__(self) -> None:
        super().__init__()
        self.dead, self.ckpts = False, [0]

    def _up(self) -> None:
        if self.dead:
            raise TimeoutError("follower unavailable")

    def report(self):
        self._up()
        return self.version, self.prepared, list(self.ckpts)

    def score(self, rnd, clusters, push_ids=None, retired=None):
        self._up()
        return super().score(rnd, clusters, push_ids, retired)

    def abort(self, rnd):
        self._up()
        super().abort(rnd)

    def commit(self, new_version):
        self._up()
        out = super().commit(new_version)
        self.ckpts = sorted({*self.ckpts, new_version})[-3:]
        return out


class Real:
    """The real leader with two fake followers on a hand-moved clock; clusters a and b."""

    def __init__(self, tmp_path, fakes=None) -> None:
        self.clock, self.fakes = ManualClock(), fakes or [Fake(), Fake()]
        cfg = LeaderConfig(followers=2, grace={"window_s": WINDOW_S},
                           membership=MembershipConfig(heartbeat_interval_s=1.0),
                           timeouts=Timeouts(push_s=60, pull_s=60),
                           penalty=PenaltyConfig(enabled=False))
        self.ledger = ChunkLedger(8, WPC)
        self.leader = Leader(cfg, connect=lambda e: self.fakes[e.index], run_dir=tmp_path,
                             ledger=self.ledger, clock=self.clock, tokens_per_window=TPW)
        self.ledger = self.leader.ledger  # a resumed leader has its own
        self.entries = [FollowerEntry(i, f"tcp://x:{i + 1}", "", [f"l{i}"], [4], incarnation=1)
                        for i in range(2)]
        for e in self.entries:
            self.leader.register_follower(e)
        self.leader.start()
        wait_for(lambda: self.leader.ready, "followers reconciled")
        self.threads: list[threading.Thread] = []
        self.replies: dict[str, object] = {}

    def join(self) -> dict[str, int]:
        first = {}
        for c in ("a", "b"):
            self.leader.join_cluster(c, [["l0", "l1"]])
            first[c] = min(ch for ch, _ in self.leader.lease(c, 2)[0])
        return first

    def push(self, chunks: dict[str, int], report: bool = True) -> dict:
        """Both clusters request a push of PER_PUSH windows more than accepted (one round)."""
        grants = {c: self.leader.request_push(c, self.leader.version, 1, 10.0,
                                              {ch: self.ledger.chunks[ch].accepted + PER_PUSH})
                  for c, ch in chunks.items()}
        assert len({g.round for g in grants.values()}) == 1
        for c, g in grants.items() if report else ():
            t = threading.Thread(target=self._done, args=(c, g.push_id), daemon=True)
            t.start()
            self.threads.append(t)
        if report:  # reported before the clock moves: every push took 0 s
            wait_for(lambda: all(slots(self.leader)[c].done for c in grants), "pushes reported")
        return grants

    def _done(self, c: str, push_id: str) -> None:
        try:
            self.replies[push_id] = self.leader.push_done(c, push_id, True, "", 30.0).verdict
        except Refused as exc:
            self.replies[push_id] = exc.code.name

    def beat(self, dt: float, silent: int | None = None) -> None:
        """Move the clock ``dt`` on; everyone but follower ``silent`` heartbeats."""
        advance(self.leader, self.clock, dt)
        for e in self.entries:
            if e.index != silent:
                self.leader.register_follower(e)
        for c in list(self.leader.clusters):
            self.leader.heartbeat(c, 0, 0, 0.0)

    def settle(self) -> None:
        for t in self.threads:
            t.join(30)
        self.threads = []
        wait_for(lambda: self.leader.phase == "idle", "round ended")

    def verdict(self, grant) -> tuple:
        v = self.leader._state.verdicts[grant.push_id]
        return v.accepted, v.version, v.reason

    def stop(self) -> None:
        for f in self.fakes:
            f.gate.set()
            f.commit_gate.set()
        self.leader.stop(timeout_s=1.0)


def _verdicts(sim: Watched, n: int) -> dict:
    return {c: sim.verdicts[f"{c}-{n}"][:2] for c in ("a", "b")}


def _reasons(sim: Watched, n: int) -> set[str]:
    return {sim.verdicts[f"{c}-{n}"][2].split(":")[0] for c in ("a", "b")}


def test_a_follower_stopped_mid_push_ends_the_round_at_once(tmp_path):
    sim = Watched(_scenario([{"follower": 1, "round": 1, "phase": "push", "action": "stop",
                              "down_s": 5.0}])).run()
    assert [k for _, k, _ in sim.fault_log] == ["follower_stop", "follower_down", "follower_up",
                                                "reconciled"]
    real = Real(tmp_path)
    try:
        chunks = real.join()
        first = real.push(chunks, report=False)  # their transfers hang on the stopped follower
        real.beat(WINDOW_S + 0.01)
        wait_for(lambda: real.leader.phase == "push", "push phase")
        real.beat(2.0, silent=1)
        real.beat(2.0, silent=1)  # 4 s silent > 3 missed heartbeats of 1 s: marked down
        real.settle()  # the round ended without waiting for its push timeout
        got = {c: real.verdict(g) for c, g in first.items()}
        assert {c: v[:2] for c, v in got.items()} == _verdicts(sim, 1) == {
            "a": (False, 0), "b": (False, 0)}
        assert {v[2] for v in got.values()} == {sim.verdicts["a-1"][2]} == {"follower 1 down"}
        assert real.ledger.accepted_windows == 0
        real.beat(0.5)  # it beats again: reconciled, ready
        wait_for(lambda: real.leader.ready, "reconciled")
        assert sim.reconciled[0] == {"version": 0, "lost": 0, "windows_lost": 0, "windows": 0,
                                     "followers": [0, 0]}
        second = real.push(chunks)
        real.beat(WINDOW_S + 0.01)
        real.settle()
        assert {c: real.verdict(g)[:2] for c, g in second.items()} == _verdicts(sim, 2) == {
            "a": (True, 1), "b": (True, 1)}
    finally:
        real.stop()


def _recovery(trace: Trace) -> list[tuple]:
    """The readiness changes, reconciliations and rollbacks, in order."""
    return [e[:4] if e[0] == "step" else e[:1] for e in trace
            if e[0] in ("reconcile_target", "rollback")
            or (e[0] == "step" and e[1] == "ReadyChanged" and not e[5])]


def test_a_follower_killed_in_its_update_is_reconciled_one_version_back(tmp_path, monkeypatch):
    sim_trace, real_trace = Trace(), Trace()
    install(monkeypatch, sim_trace)
    sim = Watched(_scenario([{"follower": 1, "round": 2, "phase": "update", "action": "kill",
                              "down_s": 5.0, "checkpoint_lag": 1}])).run()
    simulated = _recovery(sim_trace)
    install(monkeypatch, real_trace)  # (wraps the wrappers: sim_trace is read above)
    assert _verdicts(sim, 1) == {"a": (True, 1), "b": (True, 1)}
    assert _verdicts(sim, 2) == {"a": (False, 1), "b": (False, 1)}
    assert _reasons(sim, 2) == {"round failed"}
    real = Real(tmp_path)
    try:
        chunks = real.join()
        first = real.push(chunks)
        real.beat(WINDOW_S + 0.01)
        real.settle()
        assert {c: real.verdict(g)[:2] for c, g in first.items()} == _verdicts(sim, 1)
        real.fakes[1].dead = True  # killed inside round 2's update
        second = real.push(chunks)
        real.beat(WINDOW_S + 0.01)
        real.settle()
        got = {c: real.verdict(g) for c, g in second.items()}
        assert {c: v[:2] for c, v in got.items()} == _verdicts(sim, 2)
        assert {v[2].split(":")[0] for v in got.values()} == _reasons(sim, 2)
        # Restarted from its checkpoint of version 0 (one behind), as a new incarnation.
        fake = real.fakes[1]
        fake.dead, fake.version, fake.prepared, fake.ckpts = False, 0, -1, [0]
        real.entries[1].incarnation = 2
        real.beat(0.5)
        wait_for(lambda: real.leader.ready, "reconciled")
        assert sim.reconciled[-1] == {
            "version": real.leader.version, "lost": real.leader.counts["outer_steps_lost"],
            "windows_lost": 2 * PER_PUSH, "windows": real.ledger.accepted_windows,
            "followers": [f.version for f in real.fakes]} == {
            "version": 0, "lost": 1, "windows_lost": 16, "windows": 0, "followers": [0, 0]}
    finally:
        real.stop()
    # The same calls, in the same order: followers not ready in the update (the round fails),
    # reconcile_target, the ledger's rollback, ready again. The real leader also reconciles
    # its followers at its start (the simulation starts reconciled).
    startup = [("reconcile_target",), ("step", "ReadyChanged", "idle", "idle")]
    assert _recovery(real_trace) == startup + simulated
    assert simulated == [("step", "ReadyChanged", "update", "update"),
                                    ("reconcile_target",), ("rollback",),
                                    ("step", "ReadyChanged", "idle", "idle")]
    sim.ledger.check()
    assert sim.ledger.accepted_windows * TPW == sim.tokens_accepted + sum(sim._gained.values()) * TPW


def test_a_leader_killed_after_its_decision_re_serves_the_verdicts(tmp_path):
    sim = Watched(_scenario(leader=[{"round": 1, "phase": "update", "restart_s": 3.0}])).run()
    assert [k for _, k, _ in sim.fault_log] == ["leader_killed", "leader_resumed", "reconciled"]
    assert sim.counts["rejoins"] == 0
    real = Real(tmp_path)
    try:
        chunks = real.join()
        for f in real.fakes:
            f.commit_gate.clear()  # the commits never come: the leader dies here
        grants = real.push(chunks)
        real.beat(WINDOW_S + 0.01)
        wait_for(lambda: real.leader.version == 1, "decision recorded")
    finally:
        real.leader.stop(timeout_s=0.1)  # its loop is stuck in a commit: abandoned
    fakes = real.fakes
    assert all(f.prepared == 1 and f.version == 0 for f in fakes)
    for f in fakes:
        f.commit_gate.set()
    again = Real(tmp_path, fakes)  # the followers outlive the leader
    try:
        for c, g in grants.items():
            again._done(c, g.push_id)  # the clusters ask again
        got = {c: (again.replies[g.push_id].accepted, again.replies[g.push_id].version)
               for c, g in grants.items()}
        assert got == _verdicts(sim, 1) == {"a": (True, 1), "b": (True, 1)}
        assert sim.reconciled[0] == {
            "version": again.leader.version, "lost": 0, "windows_lost": 0,
            "windows": again.ledger.accepted_windows, "followers": [f.version for f in fakes]
        } == {"version": 1, "lost": 0, "windows_lost": 0, "windows": 16, "followers": [1, 1]}
        counts = again.leader.counts
        assert counts["updates_accepted"] == counts["updates_pushed"] == 2
        assert counts["tokens_accepted"] == 2 * PER_PUSH * TPW
    finally:
        again.stop()
    sim.ledger.check()
    assert sim.ledger.accepted_windows * TPW == sim.tokens_accepted + sum(sim._gained.values()) * TPW


def test_a_leader_killed_in_the_push_phase_loses_the_round(tmp_path):
    sim = Watched(_scenario(leader=[{"round": 1, "phase": "push", "restart_s": 3.0}])).run()
    assert "a-1" not in sim.verdicts and "b-1" not in sim.verdicts
    assert sim.counts["rejoins"] == 2 and sim.reconciled[0]["version"] == 0
    assert sim.reconciled[0]["windows"] == 0
    real = Real(tmp_path)
    try:
        chunks = real.join()
        grants = real.push(chunks, report=False)
        real.beat(WINDOW_S + 0.01)
        wait_for(lambda: real.leader.phase == "push", "push phase")
    finally:
        real.leader.stop(timeout_s=1.0)
    again = Real(tmp_path, real.fakes)
    try:
        for c, g in grants.items():
            again._done(c, g.push_id)
        assert {again.replies[g.push_id] for g in grants.values()} == {"UNKNOWN_PUSH"}
        assert again.leader.version == 0 and again.ledger.accepted_windows == 0
    finally:
        again.stop()
    # The round after the restart is decided normally, as in the real run's recovery.
    assert _verdicts(sim, 2) == {"a": (True, 1), "b": (True, 1)}


@pytest.mark.parametrize("faults", [
    {"followers": [{"follower": 0, "round": 2, "phase": "pull", "action": "kill", "down_s": 4.0,
                    "checkpoint_lag": 1}]},
    {"leader": [{"round": 3, "phase": "window", "restart_s": 2.0}]}])
def test_faulted_runs_are_deterministic(faults):
    a = simulate(_scenario(**faults, seed=7))
    b = simulate(_scenario(**faults, seed=7))
    assert a == b and a["rounds"]["outer_steps"] > 3


def test_a_fault_of_a_follower_that_does_not_exist_names_its_field():
    with pytest.raises(ValueError, match="followers.faults: follower = 5"):
        _scenario([{"follower": 5, "round": 1, "phase": "push", "action": "stop", "down_s": 1.0}])


def test_many_faults_at_once_keep_the_ledger_and_counts_exact():
    """Follower stops and kills, leader restarts and cluster faults in random phases (12 seeded
    plans on 3 clusters): nothing is counted twice or lost (the ledger's invariants; accepted
    tokens = its windows less those whose verdicts are not out yet) and the run goes on."""
    phases = ["window", "push", "update", "pull"]
    for k in range(12):
        r = random.Random(k)
        followers = [{"follower": r.randrange(3), "round": r.randint(1, 30),
                      "phase": r.choice(phases), "action": r.choice(["stop", "kill"]),
                      "down_s": r.choice([0.5, 3.0, 20.0]), "checkpoint_lag": r.choice([0, 1, 2])}
                     for _ in range(r.randint(1, 3))]
        leader = list({(f["round"], f["phase"]): f for f in (
            {"round": r.randint(1, 30), "phase": r.choice(phases),
             "restart_s": r.choice([1.0, 5.0, 30.0])} for _ in range(r.randint(0, 2)))}.values())
        clusters = [{"id": "a", "count": 2, "stages": 2, "step_s": 2.0, "windows_per_step": 8,
                     "uplink": {"bps": 1e8}, "mtbf_s": 400.0, "recovery_s": 30.0},
                    {"id": "c", "step_s": 3.0, "windows_per_step": 4, "uplink": {"bps": 1e8},
                     "faults": [{"push": 3, "phase": r.choice(phases)}], "recovery_s": 10.0}]
        sim = Simulation(small(seed=k, followers={"faults": followers},
                               leader={"faults": leader}, clusters=clusters)).run()
        sim.ledger.check()
        pending = sum(sim._gained.values())
        assert (sim.ledger.accepted_windows - pending) * 129 == sim.tokens_accepted, (k, sim.fault_log)
        # (a restarted leader numbers its rounds from 65: a plan for a later round never fires)
        assert sim.version >= 5 and sim.counts["leader_restarts"] <= len(leader), k
