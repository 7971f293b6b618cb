"""ZeroMQ data plane on loopback: request/reply, refusals, timeouts."""

import pytest
import torch

from dips.wire.dataplane import DataClient, DataPlaneError, DataServer, FrameError

KEY = b"s" * 32
pytestmark = pytest.mark.timeout(60)


def _echo(msg):
    if msg.header.get("op") == "boom":
        raise ValueError("field 'op' = 'boom' refused")
    return {"op": "ok", "n": len(msg.tensors)}, [(k, v * 2) for k, v in msg.tensors.items()]


@pytest.fixture
def server():
    s = DataServer(KEY, _echo).start()
    yield s
    s.stop()


def test_request_reply(server):
    c = DataClient(KEY, server.endpoint, timeout_s=10)
    t = torch.randn(64, 32).to(torch.bfloat16)
    reply = c.request({"op": "push"}, [("t", t)])
    assert reply.header["n"] == 1
    assert torch.equal(reply.tensors["t"], t * 2)
    c.close()


def test_error_reply_raises(server):
    c = DataClient(KEY, server.endpoint, timeout_s=10)
    with pytest.raises(DataPlaneError, match="boom"):
        c.request({"op": "boom"})
    assert c.request({"op": "again"}).header["op"] == "ok"
    c.close()


def test_wrong_key_is_refused_and_server_keeps_serving(server):
    bad = DataClient(b"w" * 32, server.endpoint, timeout_s=10)
    with pytest.raises(FrameError, match="unauthenticated"):
        bad.request({"op": "push"})
    bad.close()
    good = DataClient(KEY, server.endpoint, timeout_s=10)
    assert good.request({"op": "push"}).header["op"] == "ok"
    good.close()


def test_timeout_when_nobody_answers():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = DataClient(KEY, f"tcp://127.0.0.1:{port}", timeout_s=0.5)
    with pytest.raises(TimeoutError, match="no reply"):
        c.request({"op": "push"})
    c.close()
