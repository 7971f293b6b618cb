"""ZeroMQ data plane on loopback: request/reply, refusals, timeouts."""

import re
import time

import pytest
import torch

from dips.wire.dataplane import DataClient, DataPlaneError, DataServer, FrameError
from dips.wire.keys import Keyring, MemberKey, issue
from dips.wire.pki import Identity

SECRET = b"s" * 32
KEY = issue(SECRET, Identity.cluster("a"), False)  # a member's key under the server's secret


def _foreign_key():
    """A well-formed key of the same member, derived from another data secret."""
    return issue(b"w" * 32, Identity.cluster("a"), False)
pytestmark = pytest.mark.timeout(60)


def _echo(msg):
    if msg.header.get("op") == "boom":
        raise ValueError("field 'op' = 'boom' refused")
    return {"op": "ok", "n": len(msg.tensors)}, [(k, v * 2) for k, v in msg.tensors.items()]


@pytest.fixture
def server():
    s = DataServer(Keyring(SECRET), _echo).start()
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
    # The server derives this key id's key from its own secret: the request fails its mac, and
    # the error reply (under the server's key) fails the client's check in turn.
    bad = DataClient(_foreign_key(), server.endpoint, timeout_s=10)
    with pytest.raises(FrameError, match="unauthenticated"):
        bad.request({"op": "push"})
    bad.close()
    good = DataClient(KEY, server.endpoint, timeout_s=10)
    assert good.request({"op": "push"}).header["op"] == "ok"
    good.close()


def test_request_it_cannot_key_is_dropped_and_server_keeps_serving():
    """A request whose key the server cannot derive (it has no data secret yet, or the key id
    is malformed) is dropped: nothing could authenticate a reply, so the client times out."""
    unregistered = DataServer(Keyring(None), _echo).start()
    try:
        c = DataClient(KEY, unregistered.endpoint, timeout_s=0.5)
        with pytest.raises(TimeoutError, match="no reply"):
            c.request({"op": "push"})
        c.close()
    finally:
        unregistered.stop()
    keys = Keyring(SECRET)
    s = DataServer(keys, _echo).start()
    try:
        malformed = MemberKey("cluster-a/not-hex", KEY.key)
        bad = DataClient(malformed, s.endpoint, timeout_s=0.5)
        with pytest.raises(TimeoutError, match="no reply"):
            bad.request({"op": "push"})
        bad.close()
        good = DataClient(KEY, s.endpoint, timeout_s=10)
        assert good.request({"op": "push"}).header["op"] == "ok"
        good.close()
    finally:
        s.stop()


def test_authorize_refuses_a_member_and_server_keeps_serving():
    """``authorize`` sees the identity the key was issued to: its refusal is an error reply."""
    from dips.algo.refusal import Refusal, Refused

    def only_a(sender, header):
        if sender != Identity.cluster("a"):
            raise Refused(Refusal.FORBIDDEN, f"{sender.name!r} may not")

    s = DataServer(Keyring(SECRET), _echo, authorize=only_a).start()
    try:
        other = DataClient(issue(SECRET, Identity.cluster("b"), False), s.endpoint, timeout_s=10)
        with pytest.raises(DataPlaneError, match="'cluster-b' may not") as info:
            other.request({"op": "push"})
        assert info.value.code is Refusal.FORBIDDEN
        other.close()
        good = DataClient(KEY, s.endpoint, timeout_s=10)
        assert good.request({"op": "push"}).header["op"] == "ok"
        good.close()
    finally:
        s.stop()


def test_timeout_when_nobody_answers():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = DataClient(KEY, f"tcp://127.0.0.1:{port}", timeout_s=0.5)
    with pytest.raises(TimeoutError, match="no reply"):
        c.request({"op": "push"})
    c.close()


# ----- streams (§10): chunked push/pull through the three server threads ------------------
from dips.wire.stream import TensorSpec  # noqa: E402


class _Sink:
    def __init__(self, owner, specs):
        self.owner, self.specs = owner, specs
        self.bufs = [bytearray(s.nbytes) for s in specs]

    def write(self, index, offset, data):
        self.owner.writes.append((index, offset, len(data)))
        if self.owner.refuse_at is not None and offset >= self.owner.refuse_at:
            raise ValueError(f"field 'offset' = {offset} refused")
        self.bufs[index][offset:offset + len(data)] = data

    def commit(self):
        self.owner.committed.append(self)
        return {"op": "ack", "n": len(self.specs)}

    def abort(self, reason):
        self.owner.aborted.append(reason)


class _Source:
    def __init__(self, owner, header):
        self.owner = owner
        self.header = {"op": "model", "got": header.get("want")}
        self.tensors = owner.served
        self.specs = [TensorSpec.of(n, t) for n, t in self.tensors]

    def tensor(self, i):
        return self.tensors[i][1]

    def finish(self):
        if self.owner.stale:
            raise ValueError("field 'version' moved on")


class _Streams:
    def __init__(self):
        self.committed, self.aborted, self.writes = [], [], []
        self.refuse_at = None
        self.stale = False
        g = torch.Generator().manual_seed(3)
        self.served = [("a", torch.randn(300, 7, generator=g).to(torch.bfloat16)),
                       ("b", torch.randn(5, generator=g))]

    def handle(self, msg):
        return _echo(msg)

    def open_push(self, header, specs):
        if header.get("layer") == "bad":
            raise ValueError("push field 'layer' = 'bad' is not owned")
        return _Sink(self, specs)

    def open_pull(self, header):
        return _Source(self, header)


@pytest.fixture
def streams():
    st = _Streams()
    s = DataServer(Keyring(SECRET), st.handle).start()  # streams found through the bound method
    yield st, s
    s.stop()


def _layer():
    g = torch.Generator().manual_seed(1)
    return [("w", torch.randn(64, 65, generator=g).to(torch.bfloat16)),
            ("b", torch.randn(3, generator=g).to(torch.bfloat16))]


def test_stream_push_arrives_whole(streams):
    st, server = streams
    sent = []
    c = DataClient(KEY, server.endpoint, timeout_s=10, limiter=sent.append)
    tensors = _layer()
    reply = c.push({"op": "push", "layer": "L"}, tensors, chunk_bytes=1024)
    assert reply == {"op": "ack", "n": 2}
    sink = st.committed[-1]
    for (n, t), buf in zip(tensors, sink.bufs):
        assert torch.equal(torch.frombuffer(buf, dtype=torch.bfloat16).reshape(t.shape), t)
    # limiter saw begin + every chunk (64*65*2 = 8320 B -> 9 chunks; 6 B -> 1) + end
    assert len(sent) == 1 + 9 + 1 + 1 and sum(sent[1:-1]) == 64 * 65 * 2 + 6
    c.close()
    # Review of issue 15, #10: the consumer's work is busy time of phase push (added once
    # the message's work returns, which may be just after the client has its reply).
    busy = _busy_until(server, "push")
    assert busy["push"] > 0 and busy["update"] == 0


def _busy_until(server, phase: str) -> dict:
    """The server's busy seconds by phase, taken until ``phase`` has some (20 s at most)."""
    total: dict = {}
    deadline = time.monotonic() + 20.0
    while not total.get(phase):
        assert time.monotonic() < deadline, f"no {phase} busy time"
        got = server.busy.take()
        assert 0 <= sum(got["busy_s"].values()) and got["span_s"] >= 0
        total = {k: total.get(k, 0.0) + v for k, v in got["busy_s"].items()}
        time.sleep(0.01)
    return total


def test_stream_push_refusals_and_server_keeps_serving(streams):
    st, server = streams
    c = DataClient(KEY, server.endpoint, timeout_s=10)
    with pytest.raises(DataPlaneError, match="'layer' = 'bad'"):
        c.push({"op": "push", "layer": "bad"}, _layer(), chunk_bytes=1024)
    st.refuse_at = 2048
    with pytest.raises(DataPlaneError, match="'offset' = 2048 refused"):
        c.push({"op": "push", "layer": "L"}, _layer(), chunk_bytes=1024)
    assert st.aborted == ["field 'offset' = 2048 refused"]
    st.refuse_at = None
    bad = DataClient(_foreign_key(), server.endpoint, timeout_s=10)
    with pytest.raises(FrameError, match="unauthenticated"):  # the reply, signed by the server
        bad.push({"op": "push", "layer": "L"}, _layer(), chunk_bytes=1024)
    bad.close()
    n = len(st.committed)
    assert c.push({"op": "push", "layer": "L"}, _layer(), chunk_bytes=1024)["op"] == "ack"
    assert len(st.committed) == n + 1
    c.close()


@pytest.mark.parametrize("case", ["short", "tampered", "oversized"])
def test_bad_chunk_frames_never_reach_the_sink(streams, case):
    """Chunks are consumed straight from the received ZeroMQ frame: one that is malformed,
    altered or too large fails its stream before the sink sees a byte of it."""
    import zmq

    from dips.wire.frames import decode
    from dips.wire.stream import MAX_CHUNK_BYTES, StreamWriter

    st, server = streams
    tensors = _layer()
    w = StreamWriter(KEY.key, {"op": "push", "layer": "L"}, [TensorSpec.of(n, t) for n, t in tensors],
                     1024)
    first, second = list(w.chunks(0, tensors[0][1]))[:2]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(server.endpoint)
    try:
        begin = w.begin()  # [B, key id, head, mac]: the key id follows the kind
        sock.send_multipart([begin[0], KEY.key_id.encode(), *begin[1:]])
        sock.send_multipart([bytes(p) for p in first])  # a good chunk reaches the sink
        kind, meta, tag, data = second
        if case == "short":
            parts = [kind, meta, tag]
        elif case == "tampered":
            altered = bytearray(data)
            altered[5] ^= 0x40
            parts = [kind, meta, tag, bytes(altered)]
        else:
            parts = [kind, meta, tag, bytes(MAX_CHUNK_BYTES + 20)]  # beyond a chunk + GCM tag
        sock.send_multipart(parts)
        reply = decode(KEY.key, sock.recv_multipart()[1:])
    finally:
        sock.close(0)
    want = {"short": "not \\[kind, meta, tag, data\\]", "tampered": "tag does not match",
            "oversized": "the limit is"}[case]
    assert reply.header["op"] == "error"
    assert re.search(want, reply.header["error"]), reply.header["error"]
    assert st.writes == [(0, 0, 1024)] and len(st.aborted) == 1 and not st.committed
    c = DataClient(KEY, server.endpoint, timeout_s=10)  # the server keeps serving
    assert c.push({"op": "push", "layer": "L"}, tensors, chunk_bytes=1024)["op"] == "ack"
    c.close()


def test_stream_pull_lands_in_destination(streams):
    st, server = streams
    c = DataClient(KEY, server.endpoint, timeout_s=10)
    out = [(n, torch.empty_like(t)) for n, t in st.served]
    head = c.pull({"op": "pull", "want": 4}, out, chunk_bytes=512)
    assert head == {"op": "model", "got": 4}
    for (_, got), (_, want) in zip(out, st.served):
        assert torch.equal(got, want)
    # A stream that announces other tensors than expected is refused, naming them.
    wrong = [("a", torch.empty(300, 6, dtype=torch.bfloat16)), out[1]]
    with pytest.raises(FrameError, match="stream announces"):
        c.pull({"op": "pull"}, wrong, chunk_bytes=512)
    # A source whose version moved on fails the stream instead of ending it.
    st.stale = True
    with pytest.raises(DataPlaneError, match="moved on"):
        c.pull({"op": "pull"}, out, chunk_bytes=512)
    st.stale = False
    assert c.pull({"op": "pull", "want": 5}, out, chunk_bytes=512)["got"] == 5
    c.close()
    assert _busy_until(server, "pull")["pull"] > 0


def test_stream_pull_timeout_when_nobody_answers():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = DataClient(KEY, f"tcp://127.0.0.1:{port}", timeout_s=0.5)
    with pytest.raises(TimeoutError, match="no reply"):
        c.pull({"op": "pull"}, [("a", torch.empty(3))])
    c.close()
