"""Review 25, M1: a member calling ``GetStatus`` in a loop (1,093 calls/s from 6 threads)
took 0.64 of a core of the leader and honest outer steps went 0.77x as fast: calls were
bounded in concurrency, not in rate. A member's read calls now pass a token bucket
(:class:`dips.wire.inflight.RateGate`, ``membership.read_calls_per_s``); beyond it they are
refused BUSY (RESOURCE_EXHAUSTED) while other members are served."""

from __future__ import annotations

import grpc
import pytest

from dips.algo.refusal import Refusal
from dips.spec.protocol import MembershipConfig
from dips.wire.inflight import CallGate, RateGate
from dips.wire.pb import control_pb2 as pb
from dips.wire.services import LeaderServicer
from tests.roles.test_hostile_leader import make_leader, member
from tests.servicer_context import Aborted, FakeContext

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_flooding_member_is_refused_while_another_is_served(tmp_path):
    leader, _ = make_leader(tmp_path)
    member(leader, "a")
    member(leader, "h")
    clock, cfg = Clock(), MembershipConfig()
    reads = RateGate(cfg.read_calls_per_s, cfg.read_burst, clock=clock)
    servicer = LeaderServicer(leader, None, gate=CallGate.for_server(12, reads))
    try:
        served, refused = 0, []
        for _ in range(cfg.read_burst + 50):  # one instant: the burst, then refusals
            try:
                servicer.GetStatus(pb.StatusRequest(), FakeContext("cluster-h"))
                served += 1
            except Aborted as exc:
                refused.append(exc)
        assert served == cfg.read_burst
        assert len(refused) == 50
        assert {(e.code, e.refusal) for e in refused} == {(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                           Refusal.BUSY)}
        assert "membership.read_calls_per_s" in refused[0].details
        # the other member is served at the same instant, its reads and its heartbeats
        assert servicer.GetStatus(pb.StatusRequest(), FakeContext("cluster-a")) is not None
        assert servicer.Heartbeat(pb.HeartbeatRequest(cluster_id="a"),
                                  FakeContext("cluster-a")) is not None
        # the flooding member's heartbeats are no reads: not limited by the bucket
        assert servicer.Heartbeat(pb.HeartbeatRequest(cluster_id="h"),
                                  FakeContext("cluster-h")) is not None
        clock.now += 1.0  # a second later: read_calls_per_s more calls
        for _ in range(int(cfg.read_calls_per_s)):
            servicer.GetStatus(pb.StatusRequest(), FakeContext("cluster-h"))
        with pytest.raises(Aborted):
            servicer.GetStatus(pb.StatusRequest(), FakeContext("cluster-h"))
        assert servicer.refusals.counts()[("cluster-h", "GetStatus", "BUSY")] == 51
    finally:
        leader.stop()


def test_the_rate_gate_checks_its_limits():
    with pytest.raises(ValueError, match="rate"):
        RateGate(0.0, 10)
    with pytest.raises(ValueError, match="burst"):
        RateGate(1.0, 0)
