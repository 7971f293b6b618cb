"""One member's flood of calls waits in its own client, not ahead of everyone else's calls at
the server (issue 13, review of 2026-12-01, finding F1: 2,000 outstanding Heartbeat /
GetStatus calls of one member queued in the leader's gRPC server; honest heartbeats waited up
to 2.3 s and honest clusters were removed for missed heartbeats)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from dips.wire.control import STREAMS_PER_CONNECTION, make_server

pytestmark = pytest.mark.timeout(120)
METHOD = "/dips.test.Block/Call"


def wait_for(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.01)


class Blocking:
    """A method whose calls wait for ``release``; counts the calls in it per caller."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.inside: dict[str, int] = {}
        self.most: dict[str, int] = {}

    def call(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        who = dict(context.invocation_metadata()).get("who", "?")
        with self.lock:
            self.inside[who] = self.inside.get(who, 0) + 1
            self.most[who] = max(self.most.get(who, 0), self.inside[who])
        self.release.wait(60)
        with self.lock:
            self.inside[who] -= 1
        return request

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler("dips.test.Block", {
            "Call": grpc.unary_unary_rpc_method_handler(self.call),
            "Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request)})


def channel(port: int) -> grpc.Channel:
    return grpc.insecure_channel(f"127.0.0.1:{port}",
                                 options=[("grpc.use_local_subchannel_pool", 1)])


def test_one_connection_has_at_most_streams_per_connection_calls_at_the_server():
    blocking = Blocking()
    server = make_server(max_workers=20)
    server.add_generic_rpc_handlers((blocking.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    flooder, honest = channel(port), channel(port)
    try:
        # A connection learns the limit from the server's first SETTINGS frame; streams opened
        # before it arrives are refused (RST_STREAM REFUSED_STREAM), as HTTP/2 says.
        for ch in (flooder, honest):
            assert ch.unary_unary("/dips.test.Block/Echo")(b"hi", timeout=30) == b"hi"
        flood = [flooder.unary_unary(METHOD).future(b"x", timeout=90, metadata=(("who", "h"),))
                 for _ in range(100)]
        wait_for(lambda: blocking.inside.get("h") == STREAMS_PER_CONNECTION, "flood at the server")
        # 12 of the 20 handler threads are still free, and an honest call gets one at once:
        # without the limit, the flood took all 20 and the honest call queued behind 80 more.
        answer = honest.unary_unary(METHOD).future(b"y", timeout=90, metadata=(("who", "a"),))
        wait_for(lambda: blocking.inside.get("a") == 1, "the honest call in its handler")
        assert blocking.most["h"] == STREAMS_PER_CONNECTION
        blocking.release.set()
        assert answer.result(timeout=60) == b"y"
        # The flooder's calls are answered, or refused by the transport (a stream it opened
        # while the server had no room): none waits at the server beyond the limit.
        for f in flood:
            try:
                assert f.result(timeout=60) == b"x"
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.UNAVAILABLE, exc
        assert blocking.most["h"] == STREAMS_PER_CONNECTION
    finally:
        blocking.release.set()
        flooder.close()
        honest.close()
        server.stop(0).wait(10)
