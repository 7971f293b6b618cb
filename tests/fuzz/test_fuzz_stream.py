"""Property tests of the stream codec and the pull request's fields (dips.wire.stream,
issue 13): a BEGIN, CHUNK or END of any bytes, or a BEGIN any member could sign, is either
accepted by the rules or refused with FrameError; the reader never builds anything in
proportion to the sizes a header declares; a stream with one byte altered is refused."""

from __future__ import annotations

import hmac
import tracemalloc

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from dips.wire.dataclient import xfer_id
from dips.wire.frames import FrameError
from dips.wire.stream import (
    MAX_CHUNK_BYTES,
    StreamReader,
    StreamWriter,
    TensorSpec,
    check_chunk_bytes,
)
from tests.fuzz.hostile import key_of
from tests.fuzz.strategies import fuzz, JSON, TENSOR_ENTRY, dumps

KEY = key_of("a").key
SCRATCH = memoryview(bytearray(MAX_CHUNK_BYTES))
pytestmark = pytest.mark.timeout(120)


def _begin_mac(head: bytes) -> bytes:
    return hmac.digest(KEY, b"dips/begin" + head, "sha256")


def _reader(head: bytes, mac: bytes, encrypted: bool = False) -> StreamReader | None:
    try:
        return StreamReader(KEY, head, mac, require_encrypted=encrypted)
    except FrameError:
        return None


HEADS = st.fixed_dictionaries({
    "v": st.one_of(st.just(2), JSON), "op": st.one_of(st.just("push"), JSON),
    "xfer": st.one_of(st.just("ab" * 16), st.binary(min_size=16, max_size=16).map(bytes.hex), JSON),
    "chunk": st.one_of(st.sampled_from([256, 1024, 4 << 20]), JSON),
    "tensors": st.one_of(st.lists(TENSOR_ENTRY, max_size=4), JSON),
    "enc": st.one_of(st.just(0), st.just(1), JSON)})


@fuzz(70)
@given(st.binary(max_size=400), st.binary(max_size=40))
def test_random_begins_are_refused(head, mac):
    assert _reader(head, mac) is None


@fuzz(40)
@given(HEADS, st.lists(st.tuples(st.binary(max_size=24), st.binary(max_size=20),
                                 st.binary(max_size=1100)), max_size=4),
       st.binary(max_size=24), st.binary(max_size=40), st.booleans())
# A declared size beyond any tensor, and a tensor listed twice, every time (not left to the
# draw of the examples).
@example(header={"v": 2, "op": "push", "xfer": "ab" * 16, "chunk": 1024, "enc": 0,
                 "tensors": [{"name": "a.w", "dtype": "bf16", "shape": [2**40, 2**40]}]},
         chunks=[], end_meta=b"", end_mac=b"", valid_meta=False)
@example(header={"v": 2, "op": "push", "xfer": "ab" * 16, "chunk": 1024, "enc": 0,
                 "tensors": [{"name": "a.w", "dtype": "bf16", "shape": [2]}] * 2},
         chunks=[], end_meta=b"", end_mac=b"", valid_meta=False)
def test_signed_begins_and_random_chunks_are_accepted_by_the_rules_or_refused(
        header, chunks, end_meta, end_mac, valid_meta):
    """The reader costs memory in proportion to its header only (whatever sizes it declares);
    random chunks and a random END are refused by name."""
    head = dumps(header)
    tracemalloc.start()
    try:
        r = _reader(head, _begin_mac(head))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * len(head) + (1 << 20)
    if r is None:
        return
    assert r.chunk_bytes >= 256 and all(s.nbytes >= 0 for s in r.specs)
    for seq, (meta, tag, data) in enumerate(chunks):
        if valid_meta:
            meta = r.xfer + seq.to_bytes(4, "little")
        try:
            i, off, view = r.receive(meta, tag, memoryview(data), SCRATCH)
        except FrameError:
            continue
        assert 0 <= i < len(r.specs) and off + len(view) <= r.specs[i].nbytes
    with pytest.raises(FrameError):
        r.end(end_meta, end_mac)


@fuzz(50)
@given(st.data())
def test_a_stream_with_one_message_altered_is_refused(data):
    tensors = [("w", torch.randn(33, 17).to(torch.bfloat16)), ("b", torch.randn(40))]
    w = StreamWriter(KEY, {"op": "push", "layer": "a"}, [TensorSpec.of(n, t) for n, t in tensors],
                     256, encrypt=data.draw(st.booleans()))
    msgs = [w.begin()[1:]] + [[bytes(p) for p in c[1:]] for i, (_, t) in enumerate(tensors)
                             for c in w.chunks(i, t)] + [w.end()[1:]]
    k = data.draw(st.integers(0, len(msgs) - 1))
    # Every non-empty part counts (an encrypted chunk's tag frame is empty: GCM carries it).
    part = data.draw(st.sampled_from([p for p, raw in enumerate(msgs[k]) if raw]))
    altered = bytearray(msgs[k][part])
    pos = data.draw(st.integers(0, len(altered) - 1))
    altered[pos] ^= data.draw(st.integers(1, 255))
    msgs[k][part] = bytes(altered)
    with pytest.raises(FrameError):
        r = StreamReader(KEY, *msgs[0])
        for meta, tag, chunk in msgs[1:-1]:
            r.receive(meta, tag, memoryview(chunk), SCRATCH)
        r.end(*msgs[-1])


@fuzz(70)
@given(JSON, JSON)
@example(xfer="ab" * 10**4, chunk=10**400)  # found: the refusal quoted the 401 digits whole
def test_pull_request_fields_are_refused_by_name(xfer, chunk):
    """A pull's ``xfer`` and ``chunk`` (the fields the data server itself reads)."""
    for parse, value in ((xfer_id, xfer), (check_chunk_bytes, chunk)):
        try:
            parse(value)
        except FrameError as exc:
            assert len(str(exc)) < 300  # a huge value is cut, not echoed
