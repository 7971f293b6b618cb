"""The per-shard checksum the followers, the leader and a torchrun cluster's replicas compare
(dips.roles.shard_checksum.shard_checksum), and its one-parameter-at-a-time form (ShardHasher) that
a sharded or GPU replica uses so it never holds a whole shard on the host."""

from __future__ import annotations

import pytest
import torch
import xxhash

from dips.roles.shard_checksum import ShardHasher, shard_checksum

pytestmark = pytest.mark.timeout(30)


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"b.weight": torch.randn(3, 4, generator=g), "a.bias": torch.randn(5, generator=g),
            "c.weight": torch.randn(2, 2, 2, generator=g).transpose(0, 1)}  # not contiguous


def test_the_checksum_is_xxh3_of_names_and_fp32_bytes_in_name_order():
    params = _params()
    h = xxhash.xxh3_64()
    for name in ("a.bias", "b.weight", "c.weight"):
        h.update(name.encode())
        h.update(params[name].contiguous().numpy().tobytes())
    assert shard_checksum(params) == h.hexdigest()


def test_fed_one_parameter_at_a_time_in_name_order_it_is_the_same_checksum():
    params = _params()
    hasher = ShardHasher()
    for name in sorted(params):
        hasher.add(name, params[name].clone())
    assert hasher.hexdigest() == shard_checksum(params)
    changed = dict(params, **{"a.bias": params["a.bias"] + 1e-3})
    assert shard_checksum(changed) != shard_checksum(params)
    out_of_order = ShardHasher()
    for name in sorted(params, reverse=True):
        out_of_order.add(name, params[name])
    assert out_of_order.hexdigest() != shard_checksum(params)
