"""Tensor frame codec: round trips and refusals (each refusal names what was wrong)."""

import json

import pytest
import torch

from dips.wire.frames import FrameError, decode, encode

KEY = b"k" * 32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 3, 4), (0, 4)])
def test_round_trip(dtype, shape):
    t = torch.randn(shape).to(dtype)
    frames = encode(KEY, {"op": "push", "layer": "layers.0"}, [("w", t), ("b", t + 1)])
    msg = decode(KEY, [bytes(f) for f in frames])
    assert msg.header == {"op": "push", "layer": "layers.0"}
    assert list(msg.tensors) == ["w", "b"]
    for got, want in zip(msg.tensors.values(), (t, t + 1)):
        assert got.dtype == dtype and tuple(got.shape) == tuple(shape)
        assert torch.equal(got, want)


def test_decoded_tensor_owns_its_memory():
    t = torch.arange(6, dtype=torch.float32)
    frames = [bytearray(bytes(f)) for f in encode(KEY, {"op": "x"}, [("t", t)])]
    msg = decode(KEY, frames)
    frames[2][:] = b"\0" * len(frames[2])
    assert torch.equal(msg.tensors["t"], t)


def _frames(tensors=(("w", torch.ones(2, 3)),), header=None):
    return [bytes(f) for f in encode(KEY, header or {"op": "push"}, list(tensors))]


def test_truncated_payload_refused():
    frames = _frames()
    with pytest.raises(FrameError, match="mac"):
        decode(KEY, frames[:2] + [frames[2][:-4]])


def test_missing_payload_frame_refused():
    frames = _frames()
    with pytest.raises(FrameError):
        decode(KEY, frames[:2])
    with pytest.raises(FrameError, match="frame count"):
        decode(KEY, frames[:1])


def _resign(head: dict, payloads: list[bytes]) -> list[bytes]:
    import hashlib
    import hmac

    raw = json.dumps(head).encode()
    mac = hmac.new(KEY, digestmod=hashlib.sha256)
    for p in [raw, *payloads]:
        mac.update(p)
    return [raw, mac.digest(), *payloads]


def test_shape_mismatch_refused_even_when_signed():
    head = {"v": 1, "op": "push", "tensors": [{"name": "w", "dtype": "fp32", "shape": [4, 3]}]}
    with pytest.raises(FrameError, match=r"'w'.*24 bytes.*\[4, 3\].*48"):
        decode(KEY, _resign(head, [b"\0" * 24]))


def test_dtype_and_count_mismatch_refused():
    head = {"v": 1, "op": "push", "tensors": [{"name": "w", "dtype": "int8", "shape": [4]}]}
    with pytest.raises(FrameError, match="dtype.*int8"):
        decode(KEY, _resign(head, [b"\0" * 4]))
    head = {"v": 1, "op": "push", "tensors": []}
    with pytest.raises(FrameError, match="0 tensors but 1 payload"):
        decode(KEY, _resign(head, [b"\0" * 4]))


def test_wrong_key_and_altered_header_refused():
    frames = _frames()
    with pytest.raises(FrameError, match="unauthenticated"):
        decode(b"x" * 32, frames)
    altered = [frames[0].replace(b"push", b"pull"), *frames[1:]]
    with pytest.raises(FrameError, match="unauthenticated"):
        decode(KEY, altered)


def test_non_finite_refused_unless_allowed():
    t = torch.tensor([1.0, float("nan")])
    frames = _frames([("w", t)])
    with pytest.raises(FrameError, match="'w'.*NaN"):
        decode(KEY, frames)
    assert torch.isnan(decode(KEY, frames, require_finite=False).tensors["w"][1])


def test_encode_rejects_bad_input():
    with pytest.raises(FrameError, match="'op'"):
        encode(KEY, {"layer": "x"})
    with pytest.raises(FrameError, match="int64"):
        encode(KEY, {"op": "push"}, [("i", torch.ones(2, dtype=torch.int64))])
    with pytest.raises(FrameError, match="reserved"):
        encode(KEY, {"op": "push", "tensors": []})


def test_version_mismatch_refused():
    head = {"v": 2, "op": "push", "tensors": []}
    with pytest.raises(FrameError, match="'v' = 2"):
        decode(KEY, _resign(head, []))
