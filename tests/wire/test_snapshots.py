"""Per-version BF16 snapshots of a follower: a slow puller keeps its version (§6, §10).

Without the pull barrier the next outer step may commit while a cluster is still pulling the
previous version; the follower then serves that version from its completed snapshot, never a
mix of versions, and never recycles a snapshot a stream is still reading.
"""

from __future__ import annotations

import gc

import pytest
import torch

from dips.algo.refusal import Refusal, Refused

from dips.roles.follower import FollowerShard
from dips.wire.frames import tensor_bytes
from dips.wire.pool import VersionedSnapshots
from dips.wire.stream import TensorSpec

pytestmark = pytest.mark.timeout(60)

SHAPES = {"a": (64, 32), "b": (32,), "c": (16, 16)}
LAYERS = {"l0": ["a", "b"], "l1": ["c"]}


def _shard() -> FollowerShard:
    g = torch.Generator().manual_seed(0)
    return FollowerShard(0, LAYERS, {n: torch.randn(s, generator=g) for n, s in SHAPES.items()})


def _step(shard: FollowerShard, rnd: int) -> None:
    """One outer step with a single streamed push (θ changes, version += 1)."""
    g = torch.Generator().manual_seed(rnd)
    for layer, names in shard.layers.items():
        local = {n: (shard.params[n] + 0.1 * torch.randn(SHAPES[n], generator=g)).to(torch.bfloat16)
                 for n in names}
        sink = shard.open_push({"op": "push", "cluster": "x", "round": rnd, "layer": layer,
                                "tokens": 10}, [TensorSpec.of(n, t) for n, t in local.items()])
        for i, t in enumerate(local.values()):
            sink.write(i, 0, tensor_bytes(t))
        sink.commit()
    shard.score(rnd, ["x"])
    shard.aggregate(rnd, ["x"], [1.0])
    shard.apply(rnd, 1.0, shard.version + 1, ["x"], [1.0])
    shard.commit(shard.version + 1)


def _pull_header(version: int) -> dict:
    return {"op": "pull", "version": version, "layers": list(LAYERS), "dtype": "bf16"}


def test_a_pull_that_spans_a_commit_gets_its_whole_version():
    shard = _shard()
    want = {n: t.to(torch.bfloat16) for n, t in shard.params.items()}
    src = shard.open_pull(_pull_header(0))
    first = src.tensor(0).clone()  # the slow puller has sent one tensor ...
    _step(shard, 1)  # ... when version 1 is committed
    assert shard.version == 1
    rest = [src.tensor(i).clone() for i in range(1, len(src.specs))]
    src.finish()
    src.close()  # the data plane closes it once its messages are written
    got = dict(zip([s.name for s in src.specs], [first, *rest]))
    for n in SHAPES:
        assert torch.equal(got[n], want[n]), n
    late = shard.open_pull(_pull_header(0))  # a later puller of version 0 is still served
    assert torch.equal(late.tensor(2), want["c"])
    late.finish()
    late.close()
    for rnd in (2, 3):  # versions 2 and 3 are pulled: keep = 2 snapshots, 0's is recycled
        _step(shard, rnd)
        shard.open_pull(_pull_header(rnd)).finish()
    with pytest.raises(Refused) as info:
        shard.open_pull(_pull_header(0))
    assert info.value.code is Refusal.VERSION_GONE


def test_a_version_nobody_snapshotted_is_refused_after_it_moved_on():
    shard = _shard()
    _step(shard, 1)
    with pytest.raises(Refused, match="'version' = 0") as info:
        shard.open_pull(_pull_header(0))
    assert info.value.code is Refusal.VERSION_GONE


def test_snapshots_being_read_are_never_recycled():
    snaps = VersionedSnapshots({"a": ((4,), torch.bfloat16)}, keep=2)
    one = snaps.get(1)
    one.readers += 1
    snaps.get(2)
    three = snaps.get(3)  # 2 is unread: its buffers are recycled, 1 is kept for its reader
    assert snaps.peek(1) is one and snaps.peek(2) is None and snaps.allocated == 2
    three.readers += 1
    snaps.get(4)  # every kept snapshot is being read: a new set
    assert snaps.allocated == 3 and snaps.peek(1) is one and snaps.peek(3) is three
    one.readers -= 1
    three.readers -= 1
    snaps.get(5)  # once unread, the extra sets go back to keep = 2
    assert sorted(v for v in (1, 3, 4, 5) if snaps.peek(v)) == [4, 5]


def test_a_dropped_stream_releases_its_snapshot():
    shard = _shard()
    src = shard.open_pull(_pull_header(0))
    snap = shard._stream_pools()[1].peek(0)
    assert snap.readers == 1
    del src  # e.g. the puller vanished mid-stream: no finish()
    gc.collect()
    assert snap.readers == 0
