"""A control server keeps a bounded number of connections open (issue 13, review 30: 1,500
idle TLS connections of one certificate took the leader from 425 to 553 MB, and only the
file-descriptor limit, 20,000 there, bounded them). gRPC Python has no hook per connection or
per peer (a connection that makes no call never reaches Python), so the bound is server-wide
(``grpc.max_allowed_incoming_connections``): beyond it a new connection is closed at once,
while the connections already open keep working."""

from __future__ import annotations

import resource

import grpc
import pytest

from dips.wire.control_server import SERVER_CONNECTIONS, connection_limit, make_server

pytestmark = pytest.mark.timeout(120)
ECHO = "/dips.test.Echo/Call"


def _echo() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler("dips.test.Echo", {
        "Call": grpc.unary_unary_rpc_method_handler(lambda request, context: request)})


def _channel(port: int, i: int) -> grpc.Channel:
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=[
        ("grpc.use_local_subchannel_pool", 1), ("grpc.channel_id", i),
        ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)])


def _call(ch: grpc.Channel, wait: bool) -> bytes:
    return ch.unary_unary(ECHO)(b"x", timeout=30, wait_for_ready=wait)


def test_connections_beyond_the_limit_are_closed_and_the_open_ones_keep_working():
    server = make_server(max_workers=2, connections=4)
    server.add_generic_rpc_handlers((_echo(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    held = [_channel(port, i) for i in range(4)]
    extra = _channel(port, 99)
    try:
        assert server.connections == 4
        for ch in held:  # one member's 4 connections, each answered once
            assert _call(ch, wait=True) == b"x"
        with pytest.raises(grpc.RpcError) as info:  # a fifth: closed by the server at once
            _call(extra, wait=False)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        for ch in held:  # those open still serve
            assert _call(ch, wait=False) == b"x"
        held.pop().close()  # one closes: a new connection is accepted again
        fresh = _channel(port, 100)
        held.append(fresh)
        assert _call(fresh, wait=True) == b"x"
    finally:
        for ch in (*held, extra):
            ch.close()
        assert server.stop(grace=1.0).wait(10)


def test_the_limit_leaves_half_the_file_descriptors_to_the_process():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = connection_limit()
    assert 1 <= limit <= SERVER_CONNECTIONS
    if soft != resource.RLIM_INFINITY:
        assert limit <= soft // 2
    assert connection_limit(3) == min(3, limit)
    with pytest.raises(ValueError, match="connections 0"):
        connection_limit(0)
