"""Review 25 ("a slow writer holds every leader thread"): a member that opens calls (HTTP/2
HEADERS) and never sends their request messages. gRPC's thread-pool server waited for each
message on a handler thread, so 3 connections x 8 such calls held all the threads of the
leader and honest heartbeats failed. The control server now receives requests on its event
loop (:class:`dips.wire.control_server.ControlServer`): a call takes a thread only once its
request has arrived. Then (issue 13, review 25 follow-up) 20 connections x 8 held calls of
one certificate filled gRPC's server-wide call limit and every other call was refused
RESOURCE_EXHAUSTED: a peer now has at most PEER_CALLS open calls, each for at most
FIRST_MESSAGE_S before its request."""

from __future__ import annotations

import threading

import grpc
import pytest

from dips.algo.refusal import Refusal
from dips.wire.control import Client, make_server, refusal_of
from dips.wire.control_server import STREAMS_PER_CONNECTION
from dips.wire.inflight import PEER_CALLS, CallGate
from dips.wire.pb import control_pb2 as pb
from dips.wire.pb import control_pb2_grpc as pbg
from dips.wire.pki import Identity
from dips.wire.security import IDENTITY_KEY, Credentials
from dips.wire.services import LeaderServicer
from tests.roles.test_hostile_leader import make_leader, member

pytestmark = pytest.mark.timeout(120)
WORKERS = 4
#: The server-wide limit before the fix: 8 calls per handler thread.
OLD_SERVER_CALLS = 8 * WORKERS


class SlowWriter:
    """Opens calls on ``connections`` connections (``STREAMS_PER_CONNECTION`` each) whose
    request iterators never yield, as ``identity`` (claimed: insecure server) or as no one."""

    def __init__(self, address: str, connections: int, identity: str | None = None) -> None:
        self.never = threading.Event()
        self.channels, self.calls = [], []
        meta = () if identity is None else ((IDENTITY_KEY, identity),)
        for c in range(connections):
            ch = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1),
                                                         ("grpc.channel_id", c)])
            self.channels.append(ch)
            grpc.channel_ready_future(ch).result(timeout=30)
            call = ch.stream_unary("/dips.v1.Leader/Heartbeat",
                                   request_serializer=lambda x: x,
                                   response_deserializer=lambda b: b)
            self.calls += [call.future(self._no_message(), timeout=110, metadata=meta)
                           for _ in range(STREAMS_PER_CONNECTION)]

    def _no_message(self):  # HEADERS, then nothing
        self.never.wait(120)
        return
        yield

    def close(self) -> None:
        self.never.set()
        for f in self.calls:
            f.cancel()
        for ch in self.channels:
            ch.close()


@pytest.fixture()
def served(tmp_path):
    leader, _ = make_leader(tmp_path)
    member(leader, "a")
    servers = []

    def serve(**limits):
        server = make_server(max_workers=WORKERS, **limits)
        pbg.add_LeaderServicer_to_server(
            LeaderServicer(leader, None, gate=CallGate.for_server(WORKERS)), server)
        port = Credentials.insecure(Identity.leader()).add_port(server, "127.0.0.1:0")
        server.start()
        servers.append(server)
        return server, f"127.0.0.1:{port}"

    yield serve
    for server in servers:
        assert server.stop(grace=1.0).wait(10)
    leader.stop()


def done_calls(calls: list, count: int) -> list:
    """The first ``count`` of ``calls`` to end (waits for that event)."""
    ended, cond = [], threading.Condition()

    def note(f):
        with cond:
            ended.append(f)
            cond.notify_all()
    for f in calls:
        f.add_done_callback(note)
    with cond:
        assert cond.wait_for(lambda: len(ended) >= count, timeout=60), (len(ended), count)
        return ended[:count]


def honest(address: str) -> Client:
    return Client(pbg.LeaderStub, address, Credentials.insecure(Identity.cluster("a")),
                  Identity.leader(), timeout_s=20)


def beat(client: Client, times: int) -> None:
    for _ in range(times):  # each answered at once; before: DEADLINE_EXCEEDED or refused
        assert client.Heartbeat(pb.HeartbeatRequest(cluster_id="a"), timeout=20) is not None
        assert client.GetStatus(pb.StatusRequest(), timeout=20) is not None


def test_calls_whose_requests_never_arrive_hold_no_thread_of_the_leader(served):
    server, address = served()
    slow = SlowWriter(address, connections=PEER_CALLS // STREAMS_PER_CONNECTION)
    client = honest(address)
    try:
        assert len(slow.calls) > WORKERS  # more waiting calls than the server has threads
        beat(client, 5)
        assert not any(f.done() for f in slow.calls)  # the slow writer still holds its calls
    finally:
        slow.close()
        client.close()


def test_one_member_with_many_held_calls_cannot_exhaust_the_server(served):
    server, address = served()
    connections = OLD_SERVER_CALLS // STREAMS_PER_CONNECTION + 2
    slow = SlowWriter(address, connections, identity="cluster-h")
    client = honest(address)
    try:
        assert len(slow.calls) > OLD_SERVER_CALLS
        refused = done_calls(slow.calls, len(slow.calls) - PEER_CALLS)
        for f in refused:  # each call beyond the member's limit is refused at once
            err = f.exception()
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert refusal_of(err) == Refusal.BUSY
            assert "PEER_CALLS" in err.details()
        assert server.peers.of("cluster-h") == PEER_CALLS
        assert server.peers.refused == len(refused)
        beat(client, 10)  # before: RESOURCE_EXHAUSTED (Concurrent RPC limit exceeded)
        assert sum(f.done() for f in slow.calls) == len(refused)  # the rest still held
    finally:
        slow.close()
        client.close()


def test_a_call_without_its_request_ends_after_the_first_message_deadline(served):
    server, address = served(first_message_s=0.5)
    slow = SlowWriter(address, connections=1, identity="cluster-h")
    try:
        for f in slow.calls:
            with pytest.raises(grpc.RpcError) as err:
                f.result(timeout=60)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "FIRST_MESSAGE_S" in err.value.details()
        client = honest(address)
        beat(client, 1)
        client.close()
    finally:
        slow.close()
