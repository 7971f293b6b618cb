"""Property tests of the follower's push and pull handling (FollowerShard.handle, open_push,
open_pull; issue 13): any header a member can send, with any declared tensors, is either
served by the rules or refused with Refused / ValueError (the data server's typed refusals);
nothing is allocated for a push the leader did not admit, and at most one FP32 buffer per
admitted (round, cluster)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dips.algo.refusal import Refused
from dips.roles.staging import DeltaSink, RawSink
from dips.wire.frames import FrameError, Message, check_spec
from dips.wire.stream import ChunkPlan, TensorSpec
from tests.fuzz.hostile import LAYERS, SHAPES, local, pid, shard
from tests.fuzz.strategies import TENSOR_ENTRY, fuzz, pull_headers, push_headers

pytestmark = pytest.mark.timeout(120)
REFUSALS = (Refused, ValueError)  # ValueError includes FrameError: INVALID_ARGUMENT


def _specs(entries) -> list[TensorSpec]:
    """The tensors a BEGIN declares, as the stream reader lets them through."""
    out = []
    for e in entries:
        try:
            out.append(TensorSpec(*check_spec(e)))
        except FrameError:
            pass
    return out


def _allocations_bounded(s) -> None:
    admitted = {(1, "a")}
    assert set(s._staged) <= admitted and set(s._early) <= {pid(1)}
    pools = getattr(s, "_pools", None)
    assert pools is None or pools[0].live <= len(s._staged)
    assert pools is None or pools[0].allocated <= 1
    sums = getattr(s, "_sum_pool", None)
    assert sums is None or sums.allocated == 0  # one contributor: no round-sum buffers


def _feed(sink, specs, data) -> None:
    """Random bytes through the sink as the consumer would, then commit (or abort)."""
    plan = ChunkPlan(specs, 1024)
    try:
        for seq in range(plan.count):
            i, off, n = plan[seq]
            sink.write(i, off, memoryview(data.draw(st.binary(min_size=n, max_size=n))))
        sink.commit()
    except REFUSALS as exc:
        sink.abort(str(exc))


@fuzz(40)
@given(push_headers(), st.one_of(st.lists(TENSOR_ENTRY, max_size=3),
                                 st.sampled_from([[{"name": n, "dtype": "bf16", "shape": list(SHAPES[n])}
                                                   for n in names] for names in LAYERS.values()])),
       st.data())
def test_streamed_pushes_are_admitted_by_the_rules_or_refused(header, entries, data):
    s = shard()
    specs = _specs(entries)
    try:
        sink = s.open_push(dict(header), specs)
    except REFUSALS:
        _allocations_bounded(s)
        return
    assert isinstance(sink, (DeltaSink, RawSink))
    assert header.get("cluster") == "a" and header.get("push_id") == pid(1)  # only the ticket's
    _feed(sink, specs, data)
    _allocations_bounded(s)
    for c, valid, sq, err in s.score(1, ["a"], [pid(1)]):
        assert sq >= 0.0 and sq != float("inf") and (valid or err)


@fuzz(40)
@given(push_headers(), st.lists(st.sampled_from(list(SHAPES)), max_size=3, unique=True),
       st.sampled_from([torch.bfloat16, torch.float32]),
       st.one_of(st.floats(allow_nan=True), st.sampled_from([1e30, -1e19, 3e38])))
def test_single_message_pushes_are_admitted_by_the_rules_or_refused(header, names, dtype, fill):
    s = shard()
    values = local(1, dtype)
    tensors = {n: values[n] for n in names}
    if tensors and fill == fill:  # a finite or infinite value (the decoder refuses NaN)
        tensors[names[0]] = torch.full(tensors[names[0]].shape, fill, dtype=torch.float64).to(dtype)
    try:
        reply, out = s.handle(Message(dict(header), tensors))
    except REFUSALS:
        _allocations_bounded(s)
        return
    assert reply["op"] == "ack" and not out
    _allocations_bounded(s)
    for c, valid, sq, err in s.score(1, ["a"], [pid(1)]):
        assert sq >= 0.0 and sq != float("inf") and (valid or err)


@fuzz(35)
@given(pull_headers())
def test_pulls_are_served_by_the_rules_or_refused(header):
    s = shard()
    for serve in ("stream", "single"):
        try:
            if serve == "stream":
                src = s.open_pull(dict(header))
                got = [src.tensor(i) for i in range(len(src.specs))]
                src.finish()
            else:
                _, pairs = s.handle(Message(dict(header)))
                got = [t for _, t in pairs]
        except REFUSALS:
            continue
        assert header["version"] == 0 and sum(t.numel() for t in got) <= sum(
            p.numel() for p in s.params.values())
