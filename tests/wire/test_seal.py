"""Encrypted data plane (issue 11): AES-256-GCM per chunk and per payload, bound to its
transfer and position, required of a member whose key says so."""

from __future__ import annotations

import pytest
import torch

from dips.wire.dataplane import DataClient, DataServer
from dips.wire.frames import FrameError, decode, encode, tensor_bytes
from dips.wire.keys import Keyring, issue
from dips.wire.pki import Identity
from dips.wire.stream import StreamReader, StreamWriter, TensorSpec
from tests.wire.test_dataplane import _layer, _Streams

SECRET = b"e" * 32
SEALED = issue(SECRET, Identity.cluster("a"), True)
KEY = SEALED.key
pytestmark = pytest.mark.timeout(60)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [("w", torch.randn(40, 9, generator=g).to(torch.bfloat16)), ("b", torch.randn(33, generator=g))]


def _sealed_stream(header=None):
    tensors = _tensors()
    w = StreamWriter(KEY, header or {"op": "push", "layer": "L", "round": 1},
                     [TensorSpec.of(n, t) for n, t in tensors], 256, encrypt=True)
    chunks = [[bytes(p) for p in c] for i, (_, t) in enumerate(tensors) for c in w.chunks(i, t)]
    return tensors, w.begin(), chunks, w.end()


def test_an_encrypted_stream_round_trips_and_hides_the_bytes():
    tensors, begin, chunks, end = _sealed_stream()
    plain = b"".join(bytes(tensor_bytes(t)) for _, t in tensors)
    assert all(c[2] == b"" and bytes(c[3][:-16]) not in plain for c in chunks)
    r = StreamReader(KEY, begin[1], begin[2], require_encrypted=True)
    out = [bytearray(s.nbytes) for s in r.specs]
    scratch = memoryview(bytearray(1 << 12))
    for _, meta, tag, data in chunks:
        i, off, view = r.receive(meta, tag, memoryview(data), scratch)
        out[i][off:off + len(view)] = view
    r.end(end[1], end[2])
    assert [bytes(o) for o in out] == [bytes(tensor_bytes(t)) for _, t in tensors]


def test_a_chunk_replayed_into_another_transfer_or_position_is_refused():
    _, begin, chunks, _ = _sealed_stream()
    _, begin2, _, _ = _sealed_stream({"op": "push", "layer": "L", "round": 2})
    scratch = memoryview(bytearray(1 << 12))
    other = StreamReader(KEY, begin2[1], begin2[2])  # same member key, another push
    meta2 = begin2[1]  # the other transfer's id is in its header: rebuild chunk 0's meta
    import json
    import struct
    xfer2 = bytes.fromhex(json.loads(meta2)["xfer"])
    with pytest.raises(FrameError, match="replayed"):
        other.receive(struct.pack("<16sI", xfer2, 0), b"", memoryview(chunks[0][3]), scratch)
    same = StreamReader(KEY, begin[1], begin[2])
    with pytest.raises(FrameError, match="replayed"):  # chunk 1's bytes at position 0
        same.receive(chunks[0][1], b"", memoryview(chunks[1][3]), scratch)
    altered = bytearray(chunks[0][3])
    altered[3] ^= 1
    fresh = StreamReader(KEY, begin[1], begin[2])
    with pytest.raises(FrameError, match="tag does not match"):
        fresh.receive(chunks[0][1], b"", memoryview(altered), scratch)


def test_plaintext_is_refused_from_a_member_that_must_encrypt():
    w = StreamWriter(KEY, {"op": "push"}, [TensorSpec.of("x", torch.ones(3))], 256)
    begin = w.begin()
    with pytest.raises(FrameError, match="not encrypted"):
        StreamReader(KEY, begin[1], begin[2], require_encrypted=True)
    frames = encode(KEY, {"op": "push"}, [("x", torch.ones(3))])
    with pytest.raises(FrameError, match="not encrypted"):
        decode(KEY, frames, require_encrypted=True)
    sealed = encode(KEY, {"op": "push"}, [("x", torch.ones(3))], encrypt=True)
    assert bytes(sealed[2]) != bytes(tensor_bytes(torch.ones(3)))
    assert torch.equal(decode(KEY, sealed, require_encrypted=True).tensors["x"], torch.ones(3))
    assert decode(KEY, encode(KEY, {"op": "ack"}), require_encrypted=True).header == {"op": "ack"}


def test_an_encrypting_member_pushes_and_pulls_through_a_data_server():
    st = _Streams()
    server = DataServer(Keyring(SECRET, encrypt=True), st.handle).start()
    try:
        with DataClient(SEALED, server.endpoint, timeout_s=10) as c:
            tensors = _layer()
            assert c.push({"op": "push", "layer": "L"}, tensors, chunk_bytes=1024)["op"] == "ack"
            got = st.committed[-1].bufs
            assert [bytes(b) for b in got] == [bytes(tensor_bytes(t)) for _, t in tensors]
            out = [(n, torch.empty_like(t)) for n, t in st.served]
            c.pull({"op": "pull"}, out, chunk_bytes=1024)
            assert all(torch.equal(o, t) for (_, o), (_, t) in zip(out, st.served))
        plain = issue(SECRET, Identity.cluster("b"), False)
        with DataClient(plain, server.endpoint, timeout_s=10) as c:
            with pytest.raises(Exception, match="not encrypted"):
                c.push({"op": "push", "layer": "L"}, _layer(), chunk_bytes=1024)
    finally:
        server.stop()


def test_the_ring_reuses_a_buffer_only_once_zeromq_released_it():
    from dips.wire.seal import SealRing

    class Tracker:
        def __init__(self, done):
            self.done = done

    ring = SealRing(slots=2)
    a = ring.take(8)
    ring.track(Tracker(done=False))  # still in flight
    b = ring.take(8)
    ring.track(Tracker(done=True))
    a2 = ring.take(8)  # slot 0 again: its buffer is in flight, so a fresh one
    assert a2.obj is not a.obj
    b2 = ring.take(4)  # slot 1: released, reused
    assert b2.obj is b.obj and len(b2) == 4


def test_a_follower_serves_current_members_keys_and_those_issued_since():
    from dips.wire.keys import seq_of

    ring = Keyring(SECRET)
    old, now = issue(SECRET, Identity.cluster("a"), False, 3), issue(SECRET, Identity.cluster("b"), False, 7)
    assert seq_of(old.key_id) == 3 and ring.current(old.key_id)  # no list yet: every key
    ring.set_members([now.key_id], next_seq=8)
    assert ring.current(now.key_id) and not ring.current(old.key_id)
    assert ring.current(issue(SECRET, Identity.cluster("c"), False, 8).key_id)  # joined since
