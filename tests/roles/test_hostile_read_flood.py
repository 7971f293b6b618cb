"""Review 25, M1: a member calling ``GetStatus`` in a loop (1,093 calls/s from 6 threads)
took 0.64 of a core of the leader and honest outer steps went 0.77x as fast: calls were
bounded in concurrency, not in rate. The control server now passes a member's read calls
through a token bucket (:class:`dips.wire.inflight.RateGate`,
``membership.read_calls_per_s``) before they take a thread; beyond it they are refused BUSY
(RESOURCE_EXHAUSTED) while other members are served."""

from __future__ import annotations

import grpc
import pytest

from dips.algo.refusal import Refusal
from dips.spec.protocol import MembershipConfig
from dips.wire.control import Client, make_server, refusal_of
from dips.wire.inflight import CallGate, RateGate
from dips.wire.pb import control_pb2 as pb
from dips.wire.pb import control_pb2_grpc as pbg
from dips.wire.pki import Identity
from dips.wire.security import Credentials
from dips.wire.services import LeaderServicer
from tests.roles.test_hostile_leader import make_leader, member

pytestmark = pytest.mark.timeout(120)


class Clock:
    """A clock that moves only when the test moves it (seconds)."""

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
    server = make_server(max_workers=4, reads=reads)
    pbg.add_LeaderServicer_to_server(LeaderServicer(leader, None, gate=CallGate.for_server(4)),
                                     server)
    port = Credentials.insecure(Identity.leader()).add_port(server, "127.0.0.1:0")
    server.start()

    def client(cid: str) -> Client:
        return Client(pbg.LeaderStub, f"127.0.0.1:{port}",
                      Credentials.insecure(Identity.cluster(cid)), Identity.leader(),
                      timeout_s=20)

    flood, honest = client("h"), client("a")
    try:
        served, refused = 0, []
        for _ in range(cfg.read_burst + 50):  # one instant: the burst, then refusals
            try:
                flood.GetStatus(pb.StatusRequest())
                served += 1
            except grpc.RpcError as exc:
                refused.append(exc)
        assert served == cfg.read_burst and len(refused) == 50
        assert {(e.code(), refusal_of(e)) for e in refused} == {
            (grpc.StatusCode.RESOURCE_EXHAUSTED, Refusal.BUSY)}
        assert "membership.read_calls_per_s" in refused[0].details()
        assert reads.refused == 50
        # at the same instant the other member is served, reads and heartbeats alike, and
        # the flooding member's heartbeats are no reads
        assert honest.GetStatus(pb.StatusRequest()) is not None
        assert honest.Heartbeat(pb.HeartbeatRequest(cluster_id="a")) is not None
        assert flood.Heartbeat(pb.HeartbeatRequest(cluster_id="h")) is not None
        clock.now += 1.0  # a second later: read_calls_per_s more calls
        for _ in range(int(cfg.read_calls_per_s)):
            flood.GetStatus(pb.StatusRequest())
        with pytest.raises(grpc.RpcError):
            flood.GetStatus(pb.StatusRequest())
    finally:
        flood.close()
        honest.close()
        assert server.stop(grace=1.0).wait(10)
        leader.stop()


def test_the_rate_gate_checks_its_limits():
    with pytest.raises(ValueError, match="rate"):
        RateGate(0.0, 10)
    with pytest.raises(ValueError, match="burst"):
        RateGate(1.0, 0)
