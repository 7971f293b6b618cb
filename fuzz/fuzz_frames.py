"""atheris target: the single-message codec, dips.wire.frames.decode (issue 13).

Flags: bit 0 — sign: the frames are ``[header, payload...]`` and get a valid MAC (a member
holds its key), so the fuzzer reaches the JSON header and the tensor decoding; bit 1 —
require encryption. Any input must decode to a consistent message or raise FrameError;
anything else is a crash.

Run: ``python fuzz/fuzz_frames.py -max_total_time=60 CORPUS_DIR`` (``make fuzz`` runs all).
"""

from __future__ import annotations

import math
import sys

import atheris
import torch

with atheris.instrument_imports(include=["dips"]):
    from dips.wire.frames import FrameError, decode, encode

from fuzz_common import KEY, join, mac, split, write_seeds


def one(data: bytes) -> None:
    flags, frames = split(data)
    if flags & 1 and frames:
        frames = [frames[0], mac(KEY, *frames), *frames[1:]]
    try:
        msg = decode(KEY, frames, require_encrypted=bool(flags & 2))
    except FrameError:
        return
    assert isinstance(msg.header, dict) and "tensors" not in msg.header
    for t in msg.tensors.values():
        assert t.numel() == math.prod(t.shape) and bool(torch.isfinite(t).all())


def seeds() -> list[bytes]:
    t = [("w", torch.randn(5, 3).to(torch.bfloat16)), ("b", torch.randn(2))]
    out = []
    for enc in (False, True):
        head, _, *payloads = encode(KEY, {"op": "push", "cluster": "a", "round": 1, "layer": "a"},
                                    t, encrypt=enc)
        out.append(join(1 | (2 if enc else 0), [bytes(head), *map(bytes, payloads)]))
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--seeds"]:  # write the seeds into an empty corpus (fuzz/run.py)
        write_seeds(sys.argv[2], seeds())
        sys.exit(0)
    atheris.Setup(sys.argv, one)
    atheris.Fuzz()
