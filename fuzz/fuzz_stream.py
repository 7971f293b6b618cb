"""atheris target: the stream codec, dips.wire.stream.StreamReader (issue 13).

Frames: ``[head, (meta, tag, data)*, end meta, end mac]``. Flags: bit 0 — sign the BEGIN (a
member's valid MAC over ``head``); bit 1 — put each chunk in its place (the stream's id and
the next position in ``meta``); bit 2 — give each chunk its valid tag (Poly1305 under the
member's key: a member can tag any bytes), so the fuzzer reaches sizes, offsets and the END;
bit 3 — require encryption. Every input must be read by the rules or raise FrameError.
"""

from __future__ import annotations

import sys

import atheris
import torch
from cryptography.hazmat.primitives.poly1305 import Poly1305

with atheris.instrument_imports(include=["dips"]):
    from dips.wire.frames import FrameError
    from dips.wire.stream import MAX_CHUNK_BYTES, StreamReader, StreamWriter, TensorSpec
    from dips.wire import stream as _stream

from fuzz_common import KEY, join, mac, split, write_seeds

SCRATCH = memoryview(bytearray(MAX_CHUNK_BYTES))


def one(data: bytes) -> None:
    flags, frames = split(data)
    if not frames:
        return
    head = frames[0]
    body, tail = (frames[1:-2], frames[-2:]) if len(frames) >= 3 else (frames[1:], [b"", b""])
    try:
        r = StreamReader(KEY, head, mac(KEY, b"dips/begin", head) if flags & 1 else tail[1],
                         require_encrypted=bool(flags & 8))
    except FrameError:
        return
    assert r.plan.count >= 0 and len(r.xfer) == 16
    for seq in range(len(body) // 3):
        meta, tag, chunk = body[3 * seq:3 * seq + 3]
        if flags & 2:
            meta = r.xfer + seq.to_bytes(4, "little")
        if flags & 4 and not r.encrypted:
            tag = Poly1305.generate_tag(_stream._chunk_key(KEY, r.xfer, seq), chunk)
        try:
            i, off, view = r.receive(meta, tag, memoryview(chunk), SCRATCH)
        except FrameError:
            return
        assert 0 <= i < len(r.specs) and off + len(view) <= r.specs[i].nbytes
    try:
        r.end(*tail)
    except FrameError:
        return
    assert r.received == r.plan.count


def seeds() -> list[bytes]:
    tensors = [("w", torch.randn(33, 17).to(torch.bfloat16)), ("b", torch.randn(40))]
    w = StreamWriter(KEY, {"op": "push", "cluster": "a", "round": 1, "layer": "a"},
                     [TensorSpec.of(n, t) for n, t in tensors], 256)
    frames = [w.begin()[1]]
    for i, (_, t) in enumerate(tensors):
        for _, meta, tag, chunk in w.chunks(i, t):
            frames += [bytes(meta), bytes(tag), bytes(chunk)]
    return [join(1 | 2 | 4, [*frames, *map(bytes, w.end()[1:])])]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--seeds"]:  # write the seeds into an empty corpus (fuzz/run.py)
        write_seeds(sys.argv[2], seeds())
        sys.exit(0)
    atheris.Setup(sys.argv, one)
    atheris.Fuzz()
