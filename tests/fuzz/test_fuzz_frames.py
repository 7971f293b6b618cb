"""Property tests of the single-message codec (dips.wire.frames.decode, issue 13): any bytes,
and any header a member can sign, either decode to a message that is consistent with what
the header declares or are refused with FrameError; never another exception."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from dips.wire.frames import DTYPES, FrameError, Message, decode, encode
from tests.fuzz.strategies import fuzz, JSON, TENSOR_ENTRY, dumps, mac
from tests.fuzz.hostile import key_of

KEY = key_of("a").key
pytestmark = pytest.mark.timeout(120)


def _decoded(frames, **kw) -> Message | None:
    try:
        msg = decode(KEY, frames, **kw)
    except FrameError:
        return None
    assert isinstance(msg, Message) and isinstance(msg.header, dict)
    return msg


@fuzz(100)
@given(st.lists(st.binary(max_size=300), max_size=6))
def test_random_frames_are_refused(frames):
    assert _decoded(frames) is None  # nothing forges the MAC


@fuzz(100)
@given(header=st.one_of(JSON, st.fixed_dictionaries(
           {"v": st.one_of(st.just(1), JSON), "op": st.one_of(st.just("push"), JSON),
            "tensors": st.one_of(st.lists(TENSOR_ENTRY, max_size=3), JSON),
            "enc": st.one_of(st.just(0), st.just(1), JSON)})),
       payloads=st.lists(st.binary(max_size=2400), max_size=3),
       encrypted=st.booleans())
# A declared size beyond any tensor, every time (not left to the draw of the examples).
@example(header={"v": 1, "op": "push", "enc": 0,
                 "tensors": [{"name": "a.w", "dtype": "bf16", "shape": [2**40, 2**40]}]},
         payloads=[b"\x00" * 8], encrypted=False)
def test_signed_headers_decode_consistently_or_are_refused(header, payloads, encrypted):
    """A member holds a valid key: any header it signs must decode by the rules or be
    refused by name, and what is decoded never exceeds what was received."""
    head = dumps(header)
    msg = _decoded([head, mac(KEY, head, *payloads), *payloads], require_encrypted=encrypted)
    if msg is None:
        return
    assert len(msg.tensors) == len(payloads)
    for (name, t), raw in zip(msg.tensors.items(), payloads):
        assert t.dtype in DTYPES.values() and t.numel() * t.element_size() <= len(raw)
        assert math.prod(t.shape) == t.numel()


@fuzz(50)
@given(st.data())
def test_a_valid_message_with_one_frame_altered_is_refused(data):
    import torch

    tensors = [("w", torch.randn(5, 3).to(torch.bfloat16)), ("b", torch.randn(2))]
    frames = [bytes(f) for f in encode(KEY, {"op": "push", "layer": "a"}, tensors,
                                       encrypt=data.draw(st.booleans()))]
    i = data.draw(st.integers(0, len(frames) - 1))
    altered = bytearray(frames[i])
    if altered:
        j = data.draw(st.integers(0, len(altered) - 1))
        altered[j] ^= data.draw(st.integers(1, 255))
    else:
        altered = bytearray(b"x")
    frames[i] = bytes(altered)
    assert _decoded(frames) is None
