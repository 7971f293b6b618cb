"""The data plane against hostile input (issue 13): every message is answered on its own with a
typed refusal, no input stops a serving thread, a thread that dies all the same is reported,
oversized frames are dropped by libzmq before allocation, and the decoders refuse by name."""

from __future__ import annotations

import hmac
import json
import logging

import pytest
import torch
import zmq
import zmq.utils.monitor as zmon

from dips.algo.refusal import Refusal
from dips.roles.follower import FollowerShard
from dips.wire.dataclient import STREAM_FRAME_BYTES
from dips.wire.dataplane import DataClient, DataPlaneError, DataServer
from dips.wire.frames import FrameError, decode
from dips.wire.keys import Keyring, issue
from dips.wire.pki import Identity
from dips.wire.serving import MAX_OPEN_STREAMS
from dips.wire.stream import ChunkPlan, StreamReader, StreamWriter, TensorSpec, tensor_bytes
from tests.fuzz.hostile import SECRET, served, shard

KEY = issue(SECRET, Identity.cluster("a"), False)
pytestmark = pytest.mark.timeout(120)


class _Die(BaseException):
    """Escapes every per-message guard (they catch Exception): kills a serving thread."""


class _Role:
    """A handler and stream role that fails as told (field ``fail`` of the header)."""

    def __init__(self) -> None:
        self.committed = 0

    def handle(self, msg):
        fail = msg.header.get("fail")
        if fail == "type":
            raise TypeError("unhashable type: 'list'")
        if fail == "overflow":
            raise OverflowError("int too large to convert")
        if fail == "die":
            raise _Die()
        return {"op": "ok"}, list(msg.tensors.items())

    def open_push(self, header, specs):
        if header.get("fail") == "type":
            raise TypeError("bad open")
        role = self

        class Sink:
            def write(self, index, offset, data):
                if header.get("fail") == "write":
                    raise KeyError("bad write")

            def commit(self):
                if header.get("fail") == "commit":
                    raise RuntimeError("bad commit")
                role.committed += 1
                return {"op": "ack"}

            def abort(self, reason):
                if header.get("fail") == "write":
                    raise RuntimeError("bad abort too")

        return Sink()

    def open_pull(self, header):
        raise AttributeError("bad pull")


@pytest.fixture
def role_server():
    role = _Role()
    s = DataServer(Keyring(SECRET), role.handle).start()
    yield role, s
    s.stop()


def _layer():
    return [("w", torch.randn(64, 65).to(torch.bfloat16))]


def test_unexpected_exceptions_are_refused_unspecified_and_logged_once(role_server, caplog):
    role, server = role_server
    caplog.set_level(logging.WARNING, logger="dips.wire.dataplane")
    with DataClient(KEY, server.endpoint, timeout_s=30) as c:
        for fail in ("type", "overflow", "type"):
            with pytest.raises(DataPlaneError) as info:
                c.request({"op": "x", "fail": fail})
            assert info.value.code is Refusal.UNSPECIFIED
            assert "internal error" in str(info.value) and "unhashable" not in str(info.value)
        for fail in ("type", "write", "commit"):
            with pytest.raises(DataPlaneError) as info:
                c.push({"op": "push", "fail": fail}, _layer(), chunk_bytes=1024)
            assert info.value.code is Refusal.UNSPECIFIED
        with pytest.raises(DataPlaneError) as info:
            c.pull({"op": "pull"}, [("w", torch.empty(3))])
        assert info.value.code is Refusal.UNSPECIFIED
        assert c.request({"op": "x"}).header == {"op": "ok"}
        assert c.push({"op": "push"}, _layer(), chunk_bytes=1024) == {"op": "ack"}
    assert server.healthy() and role.committed == 1
    traced = [r for r in caplog.records if r.exc_info and "request" in r.getMessage()]
    assert len(traced) == 2  # TypeError once (not twice), OverflowError once


def test_a_dead_serving_thread_is_reported(role_server):
    """Item 1: a consumer thread that died left a follower that answered nothing while its
    heartbeats kept it up; now the server says it stopped serving, and why."""
    _, server = role_server
    assert server.healthy() and server.error is None
    with DataClient(KEY, server.endpoint, timeout_s=0.5) as c:
        with pytest.raises(TimeoutError):
            c.request({"op": "x", "fail": "die"})
    assert server.died.wait(30)
    assert not server.healthy() and "data-consumer" in server.error


def test_an_oversized_frame_is_dropped_before_allocation_and_the_server_keeps_serving():
    """Item 3: one unauthenticated 256 MiB message raised a follower's RSS by 256 MB; libzmq
    now drops any frame above the shard's largest legitimate one (ZMQ_MAXMSGSIZE)."""
    s = shard()
    with served(s) as server:
        limit = server._sock.getsockopt(zmq.MAXMSGSIZE)
        assert limit == s.max_message_bytes() == STREAM_FRAME_BYTES
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        mon = sock.get_monitor_socket()
        try:
            sock.connect(server.endpoint)
            sock.send_multipart([b"M", KEY.key_id.encode(), bytes(limit + (8 << 20))])
            while zmon.recv_monitor_message(mon)["event"] != zmq.EVENT_DISCONNECTED:
                pass  # the server closed the connection on the frame's size
        finally:
            sock.disable_monitor()
            mon.close(0)
            sock.close(0)
        with DataClient(KEY, server.endpoint, timeout_s=30) as c:
            reply = c.request({"op": "pull", "version": 0, "layers": ["b"]})
        assert torch.equal(reply.tensors["b.w"], s.params["b.w"].to(torch.bfloat16))
        assert server.healthy()


def test_a_client_drops_a_reply_larger_than_it_can_legitimately_receive():
    big = torch.zeros(STREAM_FRAME_BYTES // 4 + 1024)  # one FP32 tensor above the stream limit

    def echo(msg):
        return {"op": "ok"}, [("t", big)]

    server = DataServer(Keyring(SECRET), echo).start()
    try:
        with DataClient(KEY, server.endpoint, timeout_s=0.5) as small:
            with pytest.raises(TimeoutError):
                small.request({"op": "x"})
        with DataClient(KEY, server.endpoint, timeout_s=30,
                        max_message_bytes=big.numel() * 4 + 16) as enough:
            assert enough.request({"op": "x"}).tensors["t"].numel() == big.numel()
    finally:
        server.stop()


def test_stream_ids_cannot_be_reused_while_open_and_open_streams_are_bounded(role_server):
    role, server = role_server
    pairs = _layer()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.connect(server.endpoint)
    try:
        first = StreamWriter(KEY.key, {"op": "push"}, [TensorSpec.of(n, t) for n, t in pairs],
                             1024, xfer=b"x" * 16)
        again = StreamWriter(KEY.key, {"op": "push", "other": 1},
                             [TensorSpec.of(n, t) for n, t in pairs], 1024, xfer=b"x" * 16)
        for w in (first, again):
            b = w.begin()
            sock.send_multipart([b[0], KEY.key_id.encode(), *b[1:]])
        reply = decode(KEY.key, sock.recv_multipart()[1:]).header
        assert reply["code"] == Refusal.INVALID_ARGUMENT and "already open" in reply["error"]
        for parts in first.chunks(0, pairs[0][1]):  # the first stream is untouched
            sock.send_multipart([bytes(p) for p in parts])
        sock.send_multipart(first.end())
        assert decode(KEY.key, sock.recv_multipart()[1:]).header["op"] == "ack"
        specs = [TensorSpec.of(n, t) for n, t in pairs]
        for _ in range(MAX_OPEN_STREAMS + 1):
            b = StreamWriter(KEY.key, {"op": "push"}, specs, 1024).begin()
            sock.send_multipart([b[0], KEY.key_id.encode(), *b[1:]])
        reply = decode(KEY.key, sock.recv_multipart()[1:]).header
        assert reply["code"] == Refusal.BUSY
    finally:
        sock.close(0)
    assert role.committed == 1 and server.healthy()


# ----- decoders: refusals by name --------------------------------------------------------
def _frames(header: dict, payloads=()) -> list[bytes]:
    """A single message with a correct MAC around any header (a member holds a valid key)."""
    head = json.dumps(header).encode()
    mac = hmac.new(KEY.key, digestmod="sha256")
    for part in (head, *payloads):
        mac.update(part)
    return [head, mac.digest(), *payloads]


@pytest.mark.parametrize("shape, payload, match", [
    ([True, 2], b"\0" * 4, "shape"),          # item 7: booleans were taken for dimensions
    ([False], b"", "shape"),
    ([1] * 17, b"\0\0", "shape"),
    ([2**62, 2**62], b"", "exceeds"),
    ([-1], b"", "shape"),
    ([2.0], b"\0" * 4, "shape"),
])
def test_frame_shapes_are_refused_by_name(shape, payload, match):
    header = {"v": 1, "op": "push", "tensors": [{"name": "t", "dtype": "bf16", "shape": shape}]}
    with pytest.raises(FrameError, match=match):
        decode(KEY.key, _frames(header, [payload]))


def test_deeply_nested_or_huge_number_headers_are_refused_by_name():
    nested = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(FrameError, match="not JSON"):
        decode(KEY.key, [nested, hmac.digest(KEY.key, nested, "sha256")])
    huge = b'{"v": 1, "op": ' + b"9" * 5000 + b"}"
    with pytest.raises(FrameError, match="not JSON"):
        decode(KEY.key, [huge, hmac.digest(KEY.key, huge, "sha256")])
    w = StreamWriter(KEY.key, {"op": "push"}, [])
    head = w.head.replace(b'"tensors":[]', b'"tensors":' + b"[" * 50_000 + b"]" * 50_000)
    with pytest.raises(FrameError, match="not JSON"):
        StreamReader(KEY.key, head, hmac.digest(KEY.key, b"dips/begin" + head, "sha256"))


def test_stream_headers_with_boolean_or_huge_shapes_are_refused_by_name():
    for shape in ([True], [2**62, 2**62, 2**62]):
        w = StreamWriter(KEY.key, {"op": "push"}, [TensorSpec("t", "bf16", (1,))])
        head = w.head.replace(b'"shape":[1]', json.dumps({"shape": shape})[1:-1].encode()
                              .replace(b" ", b""))
        with pytest.raises(FrameError, match="shape"):
            StreamReader(KEY.key, head, hmac.digest(KEY.key, b"dips/begin" + head, "sha256"))


def test_the_chunk_plan_is_computed_on_demand():
    """A header may declare 2^40 chunks: the plan costs nothing until a chunk arrives."""
    specs = [TensorSpec("a", "fp32", (2**38,)), TensorSpec("z", "bf16", (0,)),
             TensorSpec("b", "bf16", (3,))]
    plan = ChunkPlan(specs, 1024)
    assert plan.count == 2**30 + 1
    assert plan[0] == (0, 0, 1024) and plan[2**30 - 1] == (0, 2**40 - 1024, 1024)
    assert plan[2**30] == (2, 0, 6)
    with pytest.raises(IndexError):
        plan[2**30 + 1]


# ----- a member that pulls and never reads (review of issue 13, finding 3) ----------------
@pytest.mark.parametrize("encrypt", [False, True])
def test_unread_pulls_are_refused_busy_bounded_and_released(encrypt):
    """A member sent 3,000 streamed FP32 pulls of the whole shard on one connection and never
    read: the follower queued every one (SNDHWM 0, a copy of θ per FP32 pull, fresh sealed
    buffers) and its memory grew for good. Now a cluster pulls the run's wire dtype only
    (FP32 is the operator's), at most MAX_PULLS_PER_MEMBER streams of a member are produced,
    each a window ahead of what its connection took, the extras are BUSY at once (or, beyond
    what its connection may have queued, dropped and counted: review 21), another member is
    served meanwhile, a stalled stream is dropped (its snapshot released), and what
    libzmq held is released when the connection goes."""
    import os

    from dips.wire.dataclient import MSG, PULL
    from dips.wire.frames import encode
    from dips.wire.serving import MAX_PULLS_PER_MEMBER, PULL_BYTES_PER_MEMBER
    from tests.fuzz.hostile import big_shard, deaf_socket, wait_for

    s = big_shard()
    window, chunk = 1 << 20, 1 << 20
    shape = tuple(s.params["w"].shape)
    reply_bytes = s.params["w"].numel() * 2  # one whole-shard BF16 reply
    server = DataServer(Keyring(SECRET, encrypt=encrypt), s.handle, authorize=s.authorize,
                        pull_stall_s=3.0, pull_window_bytes=window).start()
    h = issue(SECRET, Identity.cluster("h"), encrypt)
    member = Identity.cluster("h").name
    kid = h.key_id.encode()
    try:
        with DataClient(h, server.endpoint, timeout_s=30) as c:  # the review's FP32 pulls
            with pytest.raises(DataPlaneError) as info:
                c.pull({"op": "pull", "version": 0, "layers": ["w"], "dtype": "fp32"},
                       [("w", torch.empty(shape))])
            assert info.value.code is Refusal.FORBIDDEN
        n = 40
        deaf = deaf_socket(server.endpoint)
        try:
            base, admitted0 = server.pulls.admitted + server.pulls.refused, server.pulls.admitted
            for _ in range(n):
                head = {"op": "pull", "version": 0, "layers": ["w"], "xfer": os.urandom(16).hex(),
                        "chunk": chunk}
                deaf.send_multipart([PULL, kid, *encode(h.key, head)])
            wait_for(lambda: server.pulls.admitted + server.pulls.refused - base
                     + server.refusals.total("queue_full") == n,
                     what="every pull answered, or dropped by its connection's full queue")
            stats = server.pull_stats()
            assert stats["pullq_messages"] == 0
            admitted = server.pulls.admitted - admitted0
            assert admitted <= MAX_PULLS_PER_MEMBER + stats["dropped"], stats
            assert stats["streams"] <= MAX_PULLS_PER_MEMBER
            assert stats["held_bytes"] <= MAX_PULLS_PER_MEMBER * (window + chunk + 4096), stats
            assert stats["queued_bytes"] <= MAX_PULLS_PER_MEMBER * (window + chunk + 4096)
            assert stats["sealed_buffers"] <= 16 + MAX_PULLS_PER_MEMBER * (window // chunk + 2)
            assert s._pools[1].allocated == 1  # one BF16 snapshot, shared by every stream
            # Another member is served meanwhile, in full.
            b_key = issue(SECRET, Identity.cluster("b"), encrypt)
            with DataClient(b_key, server.endpoint, timeout_s=30) as b:
                out = [("w", torch.empty(shape, dtype=torch.bfloat16))]
                assert b.pull({"op": "pull", "version": 0, "layers": ["w"]}, out,
                              chunk_bytes=chunk)["version"] == 0
                assert torch.equal(out[0][1], s.params["w"].to(torch.bfloat16))
            # The stalled streams are dropped, their snapshot released; libzmq still holds
            # what they handed it, so they stay in flight for their member (BUSY) until the
            # connection goes.
            wait_for(lambda: server.pull_stats()["producing"] == 0, what="stalled streams dropped")
            assert server.pull_stats()["dropped"] >= 1
            assert s._pools[1].peek(0).readers == 0
            assert 0 < server.pulls.held(member)
            assert server.pulls.streams(member) == admitted
        finally:
            deaf.close(0)
        wait_for(lambda: server.pulls.held() == 0 and server.pulls.streams() == 0,
                 what="the closed connection's data released")
        # Single-message pulls of the whole shard, unread: the member's byte budget holds.
        deaf = deaf_socket(server.endpoint)
        try:
            before = server.pulls.admitted, server.pulls.refused
            full = server.refusals.total("queue_full")
            for _ in range(20):
                deaf.send_multipart([MSG, kid, *encode(h.key, {"op": "pull", "version": 0,
                                                                "layers": ["w"]})])
            wait_for(lambda: server.pulls.admitted + server.pulls.refused - sum(before)
                     + server.refusals.total("queue_full") - full == 20,
                     what="every pull answered, or dropped by its connection's full queue")
            admitted = server.pulls.admitted - before[0]
            assert 1 <= admitted < 20 and server.pulls.refused > before[1]
            assert server.pulls.held(member) <= PULL_BYTES_PER_MEMBER + reply_bytes + 4096
        finally:
            deaf.close(0)
        wait_for(lambda: server.pulls.held() == 0, what="the closed connection's data released")
        assert server.healthy()
    finally:
        server.stop()


def test_the_reviewers_flood_of_small_pulls_is_refused_busy():
    """The review's input as sent: many streamed pulls of a 64 kB shard on one connection
    (RCVHWM 1, RCVBUF 4 KiB), none read. What the kernel's socket buffer takes is written;
    beyond it, MAX_PULLS_PER_MEMBER streams stay in flight and every later pull is BUSY (or
    dropped, beyond what its connection may have queued), while another member pulls as
    usual."""
    import os

    from dips.wire.dataclient import PULL
    from dips.wire.frames import encode
    from dips.wire.serving import MAX_PULLS_PER_MEMBER
    from tests.fuzz.hostile import big_shard, deaf_socket, key_of, wait_for

    s = big_shard(128, 128)  # 64 kB in FP32: 32 kB a pull
    stream_bytes = 128 * 128 * 2 + 4096
    h, member = key_of("h"), Identity.cluster("h").name
    with served(s) as server:
        deaf = deaf_socket(server.endpoint)
        try:
            n = 600  # ~19 MB asked for: more than any kernel socket buffer takes
            for _ in range(n):
                head = {"op": "pull", "version": 0, "layers": ["w"],
                        "xfer": os.urandom(16).hex(), "chunk": 1 << 20}
                deaf.send_multipart([PULL, h.key_id.encode(), *encode(h.key, head)])
            wait_for(lambda: server.pulls.admitted + server.pulls.refused
                     + server.refusals.total("queue_full") == n,
                     what="every pull answered, or dropped by its connection's full queue")
            assert server.pulls.refused + server.refusals.total("queue_full") > 0
            assert server.pulls.streams(member) <= MAX_PULLS_PER_MEMBER
            assert server.pulls.held(member) <= MAX_PULLS_PER_MEMBER * stream_bytes
            assert s._pools[1].allocated == 1
            with DataClient(key_of("b"), server.endpoint, timeout_s=30) as b:
                out = [("w", torch.empty(128, 128, dtype=torch.bfloat16))]
                assert b.pull({"op": "pull", "version": 0, "layers": ["w"]}, out)["version"] == 0
                assert torch.equal(out[0][1], s.params["w"].to(torch.bfloat16))
        finally:
            deaf.close(0)
        wait_for(lambda: server.pulls.held() == 0 and server.pulls.streams() == 0,
                 what="the closed connection's data released")
        assert server.healthy()



def _step(s: FollowerShard, v: int) -> None:
    """One outer step of single-tensor shard ``s``: θ changes, version ``v`` → ``v + 1``."""
    local = (s.params["w"] + 0.01).to(torch.bfloat16)
    sink = s.open_push({"op": "push", "cluster": "x", "round": v + 1, "layer": "w",
                        "tokens": 10}, [TensorSpec.of("w", local)])
    sink.write(0, 0, tensor_bytes(local))
    sink.commit()
    s.score(v + 1, ["x"])
    s.aggregate(v + 1, ["x"], [1.0])
    s.apply(v + 1, 1.0, v + 1, ["x"], [1.0])
    s.commit(v + 1)


def _big() -> FollowerShard:
    """8 MiB a BF16 pull: more than the kernel's socket buffers take."""
    g = torch.Generator().manual_seed(0)
    return FollowerShard(0, {"w": ["w"]}, {"w": torch.randn(2048, 2048, generator=g)},
                         wire_dtype="bf16")


def test_a_slow_pullers_bytes_are_not_recycled_before_they_are_written():
    """A pull stream wholly handed to libzmq (zero-copy views of its version's BF16 snapshot)
    but not yet written to a slow peer: two newer versions pulled meanwhile must not recycle
    that snapshot under it. The slow peer then reads exactly version 0's bytes."""
    import os

    from dips.wire.dataclient import PULL
    from dips.wire.frames import encode
    from dips.wire.stream import CHUNK, END
    from tests.fuzz.hostile import deaf_socket, key_of, wait_for

    s = _big()
    want = tensor_bytes(s.params["w"].to(torch.bfloat16)).tobytes()
    h = key_of("h")
    with served(s) as server:
        slow = deaf_socket(server.endpoint)
        try:
            head = {"op": "pull", "version": 0, "layers": ["w"], "chunk": 1 << 20,
                    "xfer": os.urandom(16).hex()}
            slow.send_multipart([PULL, h.key_id.encode(), *encode(h.key, head)])
            wait_for(lambda: server.pull_stats()["bytes_sent"] >= len(want),
                     what="the stream handed to libzmq")
            with DataClient(key_of("b"), server.endpoint, timeout_s=30) as b:
                for v in (0, 1):
                    _step(s, v)
                    out = [("w", torch.empty(2048, 2048, dtype=torch.bfloat16))]
                    assert b.pull({"op": "pull", "version": v + 1, "layers": ["w"]},
                                  out)["version"] == v + 1
            got, kind = {}, None
            while kind != END:
                msg = slow.recv_multipart()
                kind = msg[0]
                if kind == CHUNK:
                    got[len(got)] = msg[3]
            assert b"".join(got[i] for i in range(len(got))) == want
        finally:
            slow.close(0)


def test_a_member_pins_no_snapshot_of_a_version_it_pulled_again_later():
    """Review 20, P: a member opened a streamed pull of each new version and read none; every
    stream pinned its version's whole-shard BF16 snapshot (follower RSS +207 → +271 MB on a
    16 MiB shard). Now a member's pull of a newer version ends its streams of older ones
    (answered VERSION_GONE), so their snapshots are recycled: two sets, not one per version."""
    import os

    from dips.wire.dataclient import PULL
    from dips.wire.frames import encode
    from tests.fuzz.hostile import deaf_socket, key_of, wait_for

    s = _big()
    h, member = key_of("h"), Identity.cluster("h").name
    with served(s) as server:
        deaf = deaf_socket(server.endpoint)
        try:
            for v in range(4):
                asked = server.pulls.admitted + server.pulls.refused
                head = {"op": "pull", "version": v, "layers": ["w"],
                        "xfer": os.urandom(16).hex(), "chunk": 1 << 20}
                deaf.send_multipart([PULL, h.key_id.encode(), *encode(h.key, head)])
                wait_for(lambda: server.pulls.admitted + server.pulls.refused > asked,
                         what=f"the pull of version {v} answered")
                assert server.pulls.streams(member) >= 1
                _step(s, v)
            assert all(s._pools[1].peek(v) is None or s._pools[1].peek(v).readers == 0
                       for v in range(3))
            assert s._pools[1].allocated == 2  # was 4: one set per version pulled
        finally:
            deaf.close(0)
        wait_for(lambda: server.pulls.streams() == 0, what="the connection's streams released")
        assert server.healthy()
