"""Durability of persisted state (issue 13, item 7): every file and the directory that names
it is fsynced before it counts; secrets are never world-readable, even for a moment."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import torch

from dips.roles import durable
from dips.roles.checkpoint import complete_versions, load_checkpoint, save_checkpoint
from dips.roles.fence import Fence


def test_write_atomic_fsyncs_the_file_then_its_directory(tmp_path, fsynced):
    target = tmp_path / "leader.json"
    durable.write_atomic(target, b"{}")
    tmp = str(tmp_path / ".leader.json.tmp")
    assert fsynced == [tmp, str(tmp_path)]  # the bytes, then the rename
    assert target.read_bytes() == b"{}" and not Path(tmp).exists()


def test_write_atomic_never_widens_the_mode_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        durable.write_atomic(tmp_path / "secret", b"k" * 32, mode=0o600)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "secret").stat().st_mode) == 0o600


def test_checkpoint_files_and_directories_are_fsynced_before_it_is_complete(tmp_path, fsynced):
    params = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    final = save_checkpoint(tmp_path, 7, 0, params, {"w": torch.zeros(2, 3)}, "c0", keep=2)
    tmp_dir = tmp_path / ".tmp-v000007"
    expected = [str(tmp_dir / "shard.safetensors"), str(tmp_dir), str(tmp_path),
                str(final / ".meta.json.tmp"), str(final)]
    assert fsynced == expected
    assert complete_versions(tmp_path) == [7]
    got, _, meta = load_checkpoint(tmp_path, 7, ["w"])
    assert torch.equal(got["w"], params["w"]) and meta["checksum"] == "c0"


def test_the_leader_term_a_follower_accepted_is_fsynced(tmp_path, fsynced):
    fence = Fence(tmp_path / "leader_term", lease_s=10.0)
    fence.check(5)
    assert str(tmp_path) in fsynced and (tmp_path / "leader_term").read_text() == "5\n"
