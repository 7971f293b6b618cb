"""A real data server (a follower's shard behind it, 127.0.0.1, a random port) fed random
messages of every kind (issue 13): random bytes, and messages a member signs with its valid
key around hostile headers. After each batch every serving thread still runs and a
legitimate pull on the same connection is answered; afterwards, a legitimate push too."""

from __future__ import annotations

import pytest
import zmq
from hypothesis import example, given
from hypothesis import strategies as st

from dips.wire.dataclient import MSG, PULL
from dips.wire.dataplane import DataClient
from dips.wire.frames import decode, encode
from dips.wire.stream import BEGIN, CHUNK, END
from tests.fuzz.hostile import SHAPES, key_of, local, pid, push_all, served, shard, step
from tests.fuzz.strategies import (
    JSON,
    TENSOR_ENTRY,
    dumps,
    fuzz,
    mac,
    pull_headers,
    push_headers,
)

KEY = key_of("a")
KID = KEY.key_id.encode()
pytestmark = pytest.mark.timeout(180)


@st.composite
def messages(draw) -> list[bytes]:
    """One multipart message a member could send (without the ROUTER's identity frame)."""
    kind = draw(st.sampled_from(["raw", "msg", "pull", "begin", "chunk", "end"]))
    if kind == "raw":
        return draw(st.lists(st.binary(max_size=64), min_size=1, max_size=5))
    header = draw(st.one_of(push_headers(), pull_headers(), JSON))
    if kind in ("msg", "pull"):
        if isinstance(header, dict):
            header = {**header, "v": 1, "xfer": draw(st.one_of(st.just("ab" * 16), JSON)),
                      "chunk": draw(st.one_of(st.just(1024), JSON))}
        payloads = draw(st.lists(st.binary(max_size=64), max_size=2))
        head = dumps(header)
        return [MSG if kind == "msg" else PULL, KID, head, mac(KEY.key, head, *payloads),
                *payloads]
    if kind == "begin":
        if isinstance(header, dict):
            header = {**header, "v": 2, "xfer": "cd" * 16, "chunk": 1024,
                      "tensors": draw(st.lists(TENSOR_ENTRY, max_size=3))}
        head = dumps(header)
        return [BEGIN, KID, head, mac(KEY.key, b"dips/begin", head)]
    xfer = bytes.fromhex("cd" * 16)  # the id of the fuzzed BEGINs
    meta = draw(st.one_of(st.binary(min_size=4, max_size=4).map(lambda seq: xfer + seq),
                          st.binary(max_size=30)))
    if kind == "chunk":
        return [CHUNK, meta, draw(st.binary(max_size=20)), draw(st.binary(max_size=1100))]
    return [END, meta, draw(st.binary(max_size=40))]


def _still_serves(sock: zmq.Socket) -> None:
    """A legitimate single-message pull on the fuzzed connection is answered (replies to
    the random messages before it are read and dropped, also a fuzzed valid pull's model of
    another layer)."""
    sock.send_multipart([MSG, KID, *encode(KEY.key, {"op": "pull", "version": 0,
                                                     "layers": ["b"]})])
    while True:
        frames = sock.recv_multipart()  # RCVTIMEO: a dead consumer fails the test here
        if frames[0] != MSG:
            continue  # a stream answering a fuzzed pull
        reply = decode(KEY.key, frames[1:])
        if reply.header.get("op") == "model" and "b.w" in reply.tensors:
            assert tuple(reply.tensors["b.w"].shape) == SHAPES["b.w"]
            return


def test_random_messages_never_stop_the_server():
    s = shard()
    with served(s) as server:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 60_000)
        sock.connect(server.endpoint)

        @fuzz(40)
        @given(st.lists(messages(), min_size=1, max_size=8))
        @example([[MSG, KID, *encode(KEY.key, {"op": "pull", "version": 0, "layers": ["a"]})]])
        def batch(msgs):
            for m in msgs:
                sock.send_multipart(m)
            _still_serves(sock)
            assert server.healthy(), server.error

        try:
            batch()
        finally:
            sock.close(0)
        assert server.healthy()
        # The follower still takes a whole legitimate round and steps on it.
        s.discard(1)  # whatever the fuzzing staged under the one valid ticket (round 1)
        with DataClient(KEY, server.endpoint, timeout_s=60) as c:
            push_all(c, local(1), 2, pid(2))
        assert step(s, 2, ["a"], [100])
