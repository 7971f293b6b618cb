"""Review 25, M1: a member calling ``GetStatus`` in a loop (1,093 calls/s from 6 threads)
took 0.64 of a core of the leader and honest outer steps went 0.77x as fast: calls were
bounded in concurrency, not in rate. The control server now passes a member's read calls
through a token bucket (:class:`dips.wire.inflight.RateGate`,
``membership.read_calls_per_s``) before they take a thread; beyond it they are refused BUSY
(RESOURCE_EXHAUSTED) while other members are served. Review 30: heartbeats were not
rate-limited (1,014/s of one member served, the leader at 0.65 cores); they pass a bucket of
their own, derived from ``membership.heartbeat_interval_s``
(:func:`dips.algo.ratelimit.heartbeat_limit`; that honest heartbeats always conform is
hand-computed in ``tests/algo/test_ratelimit.py``)."""

from __future__ import annotations

import grpc
import pytest

from dips.algo.ratelimit import heartbeat_limit
from dips.algo.refusal import Refusal
from dips.spec.protocol import MembershipConfig
from dips.wire.control import Client, make_server, refusal_of
from dips.wire.inflight import CallGate, RateGate
from dips.wire.pb import control_pb2 as pb
from dips.wire.pb import control_pb2_grpc as pbg
from dips.wire.pki import Identity
from dips.wire.security import Credentials
from dips.wire.services import LeaderServicer
from tests.roles.test_hostile_leader import make_leader, member, wait_for

pytestmark = pytest.mark.timeout(120)


class Clock:
    """A clock that moves only when the test moves it (seconds)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _serve(leader, **gates):
    """A control server (4 workers, ``gates``: make_server's rate gates) of ``leader`` on a
    free port, started; and a function giving a client of it as an identity."""
    server = make_server(max_workers=4, **gates)
    pbg.add_LeaderServicer_to_server(LeaderServicer(leader, None, gate=CallGate.for_server(4)),
                                     server)
    port = Credentials.insecure(Identity.leader()).add_port(server, "127.0.0.1:0")
    server.start()

    def client(identity: Identity) -> Client:
        return Client(pbg.LeaderStub, f"127.0.0.1:{port}", Credentials.insecure(identity),
                      Identity.leader(), timeout_s=20)
    return server, client


def test_a_flooding_member_is_refused_while_another_is_served(tmp_path):
    leader, _ = make_leader(tmp_path)
    member(leader, "a")
    member(leader, "h")
    clock, cfg = Clock(), MembershipConfig()
    reads = RateGate(cfg.read_calls_per_s, cfg.read_burst, clock=clock)
    server, client = _serve(leader, reads=reads)
    flood, honest = client(Identity.cluster("h")), client(Identity.cluster("a"))
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


def _busy(exc: grpc.RpcError) -> bool:
    return (exc.code(), refusal_of(exc)) == (grpc.StatusCode.RESOURCE_EXHAUSTED, Refusal.BUSY)


def test_a_member_flooding_heartbeats_is_refused_while_another_beats(tmp_path):
    leader, _ = make_leader(tmp_path)  # membership.heartbeat_interval_s = 1.0
    member(leader, "a")
    member(leader, "h")
    clock = Clock()
    rate, burst = heartbeat_limit(leader.cfg.membership.heartbeat_interval_s)
    beats = RateGate(rate, burst, clock=clock, what="membership.heartbeat_interval_s")
    server, client = _serve(leader, heartbeats=beats)
    flood, honest = client(Identity.cluster("h")), client(Identity.cluster("a"))
    follower = client(Identity.follower(0))
    try:
        served, refused = 0, []
        for i in range(int(burst) + 20):  # one instant: the burst, then refusals
            try:
                flood.Heartbeat(pb.HeartbeatRequest(cluster_id="h", inner_step=i))
                served += 1
            except grpc.RpcError as exc:
                refused.append(exc)
        assert (served, len(refused), beats.refused) == (8, 20, 20)
        assert all(_busy(e) for e in refused)
        assert "membership.heartbeat_interval_s" in refused[0].details()
        # the served ones count (h is heard), the refused ones reach nothing
        wait_for(lambda: leader.clusters["h"].inner_step == 7, "h's last served heartbeat")
        # at the same instant the other member beats, and the flooder's reads are no heartbeats
        assert honest.Heartbeat(pb.HeartbeatRequest(cluster_id="a")).known
        assert flood.GetStatus(pb.StatusRequest()) is not None
        clock.now += leader.cfg.membership.heartbeat_interval_s  # one interval: 4 more
        for _ in range(int(rate)):
            flood.Heartbeat(pb.HeartbeatRequest(cluster_id="h"))
        with pytest.raises(grpc.RpcError) as info:
            flood.Heartbeat(pb.HeartbeatRequest(cluster_id="h"))
        assert _busy(info.value)
        # a follower's registration is its heartbeat: limited the same way
        codes = []
        for _ in range(int(burst) + 1):
            try:
                follower.RegisterFollower(pb.FollowerInfo(index=0))
                codes.append(None)
            except grpc.RpcError as exc:
                codes.append(refusal_of(exc))
        assert Refusal.BUSY not in codes[:-1] and codes[-1] is Refusal.BUSY
    finally:
        for c in (flood, honest, follower):
            c.close()
        assert server.stop(grace=1.0).wait(10)
        leader.stop()
