"""Typed refusals: the proto enum and the Python enum agree, and a refusal crosses gRPC and
the data plane as its code (control flow never reads the message text)."""

from __future__ import annotations

import secrets

import grpc
import pytest

from dips.algo.refusal import Refusal, Refused
from dips.wire.control import Client, grpc_errors, make_server, refusal_of
from dips.wire.dataplane import DataClient, DataPlaneError, DataServer
from dips.wire.frames import Message
from dips.wire.keys import Keyring, issue
from dips.wire.pb import control_pb2 as pb
from dips.wire.pb import control_pb2_grpc as pbg
from dips.wire.pki import Identity
from dips.wire.security import Credentials

pytestmark = pytest.mark.timeout(60)


def test_proto_and_python_enums_are_the_same():
    proto = {v.name: v.number for v in pb.DESCRIPTOR.enum_types_by_name["Refusal"].values}
    ours = {("REFUSAL_" + r.name if r is Refusal.UNSPECIFIED else r.name): int(r) for r in Refusal}
    assert proto == ours


class _Refusing(pbg.LeaderServicer):
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    @grpc_errors
    def GetStatus(self, request, context):
        raise self.exc


@pytest.mark.parametrize("exc, code, status", [
    (Refused(Refusal.NOT_JOINED, "cluster 'x' has not joined"), Refusal.NOT_JOINED,
     grpc.StatusCode.FAILED_PRECONDITION),
    (Refused(Refusal.NOT_READY, "followers down"), Refusal.NOT_READY, grpc.StatusCode.UNAVAILABLE),
    (Refused(Refusal.UNDECIDED, "round 3 undecided"), Refusal.UNDECIDED,
     grpc.StatusCode.DEADLINE_EXCEEDED),
    (ValueError("field 'n' = -1"), Refusal.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT),
    (Refused(Refusal.FORBIDDEN, "only a cluster may call it"), Refusal.FORBIDDEN,
     grpc.StatusCode.PERMISSION_DENIED),
    (RuntimeError("a bug"), None, grpc.StatusCode.INTERNAL),
])
def test_a_refusal_crosses_grpc_as_its_code(exc, code, status):
    creds = Credentials.insecure(Identity.admin())
    server = make_server(max_workers=2)
    pbg.add_LeaderServicer_to_server(_Refusing(exc), server)
    port = creds.add_port(server, "127.0.0.1:0")
    server.start()
    client = Client(pbg.LeaderStub, f"127.0.0.1:{port}", creds, Identity.leader(), timeout_s=10)
    try:
        with pytest.raises(grpc.RpcError) as info:
            client.GetStatus(pb.StatusRequest())
        assert info.value.code() == status
        assert refusal_of(info.value) == code
    finally:
        client.close()
        server.stop(0)


def test_an_unreachable_peer_is_no_refusal():
    client = Client(pbg.LeaderStub, "127.0.0.1:1", Credentials.insecure(Identity.admin()),
                    Identity.leader(), timeout_s=0.5)
    try:
        with pytest.raises(grpc.RpcError) as info:
            client.GetStatus(pb.StatusRequest())
        assert refusal_of(info.value) is None
    finally:
        client.close()


def test_a_data_plane_refusal_carries_its_code():
    secret = secrets.token_bytes(32)

    def handler(msg: Message):
        if msg.header.get("op") == "pull":
            raise Refused(Refusal.VERSION_GONE, "follower 0 holds version 7")
        raise ValueError("header field 'op' is wrong")

    server = DataServer(Keyring(secret), handler).start()
    client = DataClient(issue(secret, Identity.cluster("a"), False), server.endpoint, 10.0)
    try:
        with pytest.raises(DataPlaneError) as info:
            client.request({"op": "pull", "version": 3, "layers": []})
        assert info.value.code is Refusal.VERSION_GONE
        with pytest.raises(DataPlaneError) as info:
            client.request({"op": "nonsense"})
        assert info.value.code is Refusal.INVALID_ARGUMENT
    finally:
        client.close()
        server.stop()
