"""Chunked stream codec (§10): round trips, and every refusal names what was wrong."""

from __future__ import annotations

import pytest
import torch

from dips.wire.frames import FrameError
from dips.wire.stream import (MAX_CHUNK_BYTES, StreamReader, StreamWriter, TensorSpec,
                              check_chunk_bytes, plan_chunks)

KEY = b"k" * 32


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [("w", torch.randn(33, 17, generator=g).to(torch.bfloat16)),
            ("empty", torch.zeros(0, 4, dtype=torch.bfloat16)),
            ("b", torch.randn(40, generator=g))]


def _stream(tensors=None, chunk=256, header=None):
    tensors = tensors or _tensors()
    w = StreamWriter(KEY, header or {"op": "push", "layer": "L"},
                     [TensorSpec.of(n, t) for n, t in tensors], chunk)
    chunks = [c for i, (_, t) in enumerate(tensors) for c in w.chunks(i, t)]
    return w.begin(), [[bytes(p) for p in c] for c in chunks], w.end()


def _receive(begin, chunks, end, specs_into=None):
    r = StreamReader(KEY, begin[1], begin[2])
    out = [bytearray(s.nbytes) for s in r.specs]
    for _, meta, tag, data in chunks:
        i, off = r.verify(meta, tag, memoryview(data))
        out[i][off:off + len(data)] = data
    r.end(end[1], end[2])
    return r, out


def test_plan_splits_each_tensor_on_its_own():
    specs = [TensorSpec("a", "fp32", (100,)), TensorSpec("z", "bf16", (0,)),
             TensorSpec("b", "bf16", (3,))]
    assert plan_chunks(specs, 256) == [(0, 0, 256), (0, 256, 144), (2, 0, 6)]


def test_round_trip_many_chunks():
    tensors = _tensors()
    begin, chunks, end = _stream(tensors)
    assert len(chunks) == 5 + 1  # 33*17*2 = 1122 B -> 5 chunks of 256; 160 B -> 1
    r, out = _receive(begin, chunks, end)
    assert r.header == {"op": "push", "layer": "L"}
    for (name, t), spec, raw in zip(tensors, r.specs, out):
        assert spec == TensorSpec.of(name, t)
        got = torch.frombuffer(raw, dtype=t.dtype) if raw else torch.empty(0, dtype=t.dtype)
        assert torch.equal(got.reshape(t.shape), t)


def test_truncated_stream_refused():
    begin, chunks, end = _stream()
    with pytest.raises(FrameError, match="truncated: 5 of 6"):
        _receive(begin, chunks[:-1], end)


def test_reordered_chunks_refused():
    begin, chunks, end = _stream()
    chunks[1], chunks[2] = chunks[2], chunks[1]
    with pytest.raises(FrameError, match="seq 2 arrived where seq 1 was expected"):
        _receive(begin, chunks, end)


def test_lost_chunk_refused():
    begin, chunks, end = _stream()
    with pytest.raises(FrameError, match="reordered or lost"):
        _receive(begin, chunks[:2] + chunks[3:], end)


def test_altered_chunk_refused():
    begin, chunks, end = _stream()
    data = bytearray(chunks[3][3])
    data[7] ^= 1
    chunks[3][3] = bytes(data)
    with pytest.raises(FrameError, match="chunk 3 of tensor 'w': tag does not match"):
        _receive(begin, chunks, end)


def test_chunk_size_mismatch_refused():
    begin, chunks, end = _stream()
    chunks[0][3] = chunks[0][3][:-2]
    with pytest.raises(FrameError, match="chunk 0 of tensor 'w' is 254 bytes, expected 256"):
        _receive(begin, chunks, end)


def test_chunk_of_another_stream_refused():
    begin, chunks, end = _stream()
    _, other, _ = _stream()
    with pytest.raises(FrameError, match="inside transfer"):
        _receive(begin, [other[0], *chunks[1:]], end)


def test_surplus_chunk_refused():
    begin, chunks, end = _stream()
    r = StreamReader(KEY, begin[1], begin[2])
    for _, meta, tag, data in chunks:
        r.verify(meta, tag, data)
    with pytest.raises(FrameError, match="beyond the 6 chunks"):
        r.verify(chunks[0][1][:16] + (6).to_bytes(4, "little"), chunks[0][2], chunks[0][3])


def test_wrong_key_and_altered_header_refused():
    begin, _, _ = _stream()
    with pytest.raises(FrameError, match="begin mac"):
        StreamReader(b"x" * 32, begin[1], begin[2])
    with pytest.raises(FrameError, match="begin mac"):
        StreamReader(KEY, begin[1].replace(b"push", b"pull"), begin[2])


def test_end_mac_covers_every_tag():
    begin, chunks, end = _stream()
    with pytest.raises(FrameError, match="end mac"):
        _receive(begin, chunks, [end[0], end[1], bytes(32)])


def test_writer_refuses_bad_input():
    spec = [TensorSpec("w", "bf16", (4,))]
    with pytest.raises(FrameError, match="'op'"):
        StreamWriter(KEY, {"layer": "x"}, spec)
    with pytest.raises(FrameError, match="reserved"):
        StreamWriter(KEY, {"op": "push", "chunk": 4}, spec)
    w = StreamWriter(KEY, {"op": "push"}, spec, 256)
    with pytest.raises(FrameError, match="does not match its spec"):
        list(w.chunks(0, torch.zeros(5, dtype=torch.bfloat16)))
    with pytest.raises(FrameError, match="ended after 0 of 1"):
        w.end()
    with pytest.raises(FrameError, match="int64"):
        TensorSpec.of("i", torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("bad", [0, 255, 258, MAX_CHUNK_BYTES + 4, "4096", True, None])
def test_chunk_size_validated(bad):
    with pytest.raises(FrameError, match="field 'chunk'"):
        check_chunk_bytes(bad)
