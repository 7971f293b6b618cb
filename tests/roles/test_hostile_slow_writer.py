"""Review 25 ("a slow writer holds every leader thread"): a member that opens calls (HTTP/2
HEADERS) and never sends their request messages. gRPC's thread-pool server waited for each
message on a handler thread, so 3 connections x 8 such calls held all the threads of the
leader and honest heartbeats failed. The control server now receives requests on its event
loop (:class:`dips.wire.control.ControlServer`): a call takes a thread only once its request
has arrived."""

from __future__ import annotations

import threading

import grpc
import pytest

from dips.wire.control import STREAMS_PER_CONNECTION, Client, make_server
from dips.wire.inflight import CallGate
from dips.wire.pb import control_pb2 as pb
from dips.wire.pb import control_pb2_grpc as pbg
from dips.wire.pki import Identity
from dips.wire.security import Credentials
from dips.wire.services import LeaderServicer
from tests.roles.test_hostile_leader import make_leader, member

pytestmark = pytest.mark.timeout(120)
WORKERS = 4
CONNECTIONS = 3


def test_calls_whose_requests_never_arrive_hold_no_thread_of_the_leader(tmp_path):
    leader, _ = make_leader(tmp_path)
    member(leader, "a")
    server = make_server(max_workers=WORKERS)
    pbg.add_LeaderServicer_to_server(
        LeaderServicer(leader, None, gate=CallGate.for_server(WORKERS)), server)
    port = Credentials.insecure(Identity.leader()).add_port(server, "127.0.0.1:0")
    server.start()
    address = f"127.0.0.1:{port}"
    never = threading.Event()

    def no_message():  # the request iterator of a slow writer: HEADERS, then nothing
        never.wait(120)
        return
        yield

    slow, held = [], []
    honest = Client(pbg.LeaderStub, address, Credentials.insecure(Identity.cluster("a")),
                    Identity.leader(), timeout_s=20)
    try:
        for c in range(CONNECTIONS):
            ch = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1),
                                                         ("grpc.channel_id", c)])
            slow.append(ch)
            grpc.channel_ready_future(ch).result(timeout=30)
            call = ch.stream_unary("/dips.v1.Leader/Heartbeat",
                                   request_serializer=lambda x: x,
                                   response_deserializer=lambda b: b)
            held += [call.future(no_message(), timeout=110) for _ in range(STREAMS_PER_CONNECTION)]
        assert len(held) > WORKERS  # more waiting calls than the server has threads
        for _ in range(5):  # each answered at once; before: DEADLINE_EXCEEDED after 20 s
            beat = honest.Heartbeat(pb.HeartbeatRequest(cluster_id="a"), timeout=20)
            assert beat is not None
            status = honest.GetStatus(pb.StatusRequest(), timeout=20)
            assert status is not None
        assert not any(f.done() for f in held)  # the slow writers still hold their calls
    finally:
        never.set()
        for f in held:
            f.cancel()
        for ch in slow:
            ch.close()
        honest.close()
        assert server.stop(grace=1.0).wait(10)
        leader.stop()
