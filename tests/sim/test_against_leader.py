"""The simulator calls the leader's decision functions as the real leader does (issue 16).

A real short run in this process: the real :class:`dips.roles.leader.Leader` behind its real
gRPC service on 127.0.0.1, two real follower shards behind their ZeroMQ data servers, two real
:class:`dips.roles.client.ClusterClient` with a ledger-aware data source
(:class:`dips.train.lease.LeaseSampler`), H = 2, a 0.3-s grace window, the penalty off. Four
rounds: in the first two both pushes arrive inside the window, in the last two the window
closes first (the pushes are held until the leader is in its push phase). The leader's clock
moves only by hand (tests/sim/leader_harness.py), so no outcome depends on timing.

The simulation of the same scenario (same clusters, model shape, H, window, followers, data
chunks; links fast, then slow from 5 s on, so that its rounds fall in the same two cases) runs
with the same recording stubs (tests/sim/recording.py). Compared:

* the decision functions called at all (the leader also reconciles its followers at start:
  ``reconcile_target``, and tells the machine they are ready: ``ReadyChanged``; the simulator
  starts with followers ready and does not model follower faults);
* the grammar: every (phase, event) -> phase transition one took, the other took;
* per round: the calls (a multiset), the phase changes in order, each cluster's own calls in
  order, run_update once with the round's pushes, and one ledger resolve per verdict.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dips.algo.ledger import ChunkLedger
from dips.roles.client import ClusterClient
from dips.roles.follower import FollowerShard
from dips.roles.leader import Leader, LeaderConfig
from dips.sim.engine import Simulation
from dips.spec import GraceConfig, MembershipConfig, PenaltyConfig, Timeouts
from dips.train.lease import LeaseSampler
from dips.train.model import build_model
from dips.wire.pki import Identity
from dips.wire.security import Credentials
from tests.roles.test_protocol import CFG, _perturb
from tests.roles.inprocess import add_followers, serve_leader
from tests.sim import recording
from tests.sim.helpers import small
from tests.sim.leader_harness import ManualClock, advance, slots, wait_for

pytestmark = pytest.mark.timeout(90)

WINDOW_S, H, WPS, T, WPC, CHUNKS = 0.3, 2, 4, 16, 20, 8  # grace, steps, windows/step, ...
TIMEOUTS = {"push_s": 60, "pull_s": 60, "push_floor_s": 30}


class RealRun:
    """Leader (hand-moved clock, a ledger), 2 followers and 2 clusters in this process."""

    def __init__(self, tmp_path) -> None:
        model0 = build_model(CFG, seed=0)
        self.clock = ManualClock()
        self.ledger = ChunkLedger(CHUNKS, WPC)
        cfg = LeaderConfig(grace=GraceConfig(window_s=WINDOW_S), timeouts=Timeouts(**TIMEOUTS),
                           membership=MembershipConfig(heartbeat_interval_s=1.0), followers=2,
                           penalty=PenaltyConfig(enabled=False))
        self.shards: list[FollowerShard] = []
        self.leader = Leader(cfg, connect=lambda e: self.shards[e.index], run_dir=tmp_path,
                             ledger=self.ledger, clock=self.clock, tokens_per_window=T)
        self.servers, self.clients, self.threads = [], [], []
        add_followers(self.leader, model0, tmp_path, 2, self.shards, self.servers)
        self.grpc, self.addr = serve_leader(self.leader)
        self.leader.start()
        wait_for(lambda: self.leader.ready, "followers reconciled")

    def join(self, cid: str) -> ClusterClient:
        span = WPC * (T + 1)
        data = LeaseSampler(np.zeros(CHUNKS * span, dtype=np.int64),
                            [(i * span, (i + 1) * span) for i in range(CHUNKS)], seq_len=T,
                            batch_size=WPS, seed=0)
        c = ClusterClient(build_model(CFG, seed=1), self.addr, cid,
                          Credentials.insecure(Identity.cluster(cid)), H=H, stages=1,
                          timeout_s=60, admit_timeout_s=60, heartbeat_interval_s=0.2, data=data)
        c.join()
        self.clients.append(c)
        return c

    def one_round(self, n: int, held: bool) -> None:
        """Both clusters train H steps and sync; ``held``: their pushes wait for the leader's
        push phase (else they arrive inside the window, which closes only when told)."""
        gate = threading.Event()
        results = []
        for c in self.clients:
            real = c._run_stages

            def run_stages(grant, tokens, real=real):
                assert gate.wait(60), "the pushes were never let go"
                return real(grant, tokens)

            c._run_stages = run_stages

            def train(c=c) -> None:
                for k in range(H):
                    c.data.next_windows(WPS)
                    _perturb(c.model, seed=100 * n + k)
                    res = c.step_done(WPS * T)
                results.append(res)

            t = threading.Thread(target=train, daemon=True)
            t.start()
            self.threads.append(t)
        wait_for(lambda: len(slots(self.leader)) == 2, "both admitted")
        if held:
            advance(self.leader, self.clock, WINDOW_S + 0.01)
            wait_for(lambda: self.leader.phase == "push", "push phase")
            gate.set()
        else:
            gate.set()
            wait_for(lambda: all(s.done for s in slots(self.leader).values()), "pushes in")
            advance(self.leader, self.clock, WINDOW_S + 0.01)
        for t in self.threads:
            t.join(60)
        assert len(results) == 2 and all(r is not None and r.ok and r.accepted for r in results)
        wait_for(lambda: self.leader.phase == "idle", "round ended")

    def close(self) -> None:
        for c in self.clients:
            c.close(leave=False)
        self.leader.stop()
        self.grpc.stop(0)
        for s in self.servers:
            s.stop()


def _scenario():
    link = {"bps": 1.0e8, "schedule": [{"at_s": 5.0, "bps": 1.0e5}]}
    cluster = {"stages": 1, "step_s": 1.0, "windows_per_step": WPS, "uplink": link}
    return small(H=H, model=CFG.model_dump(), penalty={"enabled": False},
                 leader={"grace": {"window_s": WINDOW_S}, "timeouts": TIMEOUTS,
                         "membership": {"heartbeat_interval_s": 1.0}},
                 followers={"count": 2, "nic_bps": 1.0e9, "update_s_per_param": 0.0},
                 clusters=[{"id": "a", **cluster}, {"id": "b", **cluster}],
                 norms={"anomaly_prob": 0.0},
                 data={"num_chunks": CHUNKS, "windows_per_chunk": WPC, "tokens_per_window": T},
                 horizon_s=40)


#: What only the real leader calls: it reconciles its followers before the first round and
#: tells the machine they are ready (the simulator starts with ready followers).
ONLY_REAL_NAMES = {"reconcile_target"}
ONLY_REAL_GRAMMAR = {("idle", "ReadyChanged", "idle")}


def test_the_simulator_decides_with_the_leaders_calls(tmp_path, monkeypatch):
    real_trace, sim_trace = recording.Trace(), recording.Trace()
    recording.install(monkeypatch, real_trace)
    run = RealRun(tmp_path)
    try:
        for cid in ("a", "b"):
            run.join(cid)
        for n, held in enumerate((False, False, True, True), 1):
            run.one_round(n, held)
        assert run.leader.version == 4
        run.ledger.check()
    finally:
        run.close()
    real = list(real_trace)
    monkeypatch.undo()
    recording.install(monkeypatch, sim_trace)
    sim = Simulation(_scenario()).run()
    assert sim.version >= 4 and not sim.refusals
    # The same decision functions, and the same grammar of the round machine.
    assert recording.names(real) - ONLY_REAL_NAMES == recording.names(sim_trace)
    assert recording.grammar(real) - ONLY_REAL_GRAMMAR == recording.grammar(sim_trace)
    # Round by round (the real run's four against the simulation's first four).
    real_rounds = recording.rounds(real, skip=("ReadyChanged",))
    sim_rounds = recording.rounds(sim_trace)
    assert len(real_rounds) == 4 and len(sim_rounds) >= 4
    for n, (r, s) in enumerate(zip(real_rounds, sim_rounds), 1):
        assert r["phases"] == s["phases"], n
        assert r["clusters"] == s["clusters"], n
        assert r["calls"] == s["calls"], n
        assert r["updates"] == s["updates"] == [(("a", "b"), ("a", "b"), n)], n
        # One resolve per verdict: both accepted, credited to this version.
        assert r["resolved"] == s["resolved"] == [("a", True, n), ("b", True, n)], n
    assert [r["phases"][1] for r in real_rounds] == [
        ("Tick", "window", "update")] * 2 + [("Tick", "window", "push")] * 2
