"""A follower's version 0: built from the seed, or read from a safetensors file or an HF
checkpoint directory; a checkpoint that does not fit the run's model is refused by name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from dips.node.common import RoleError
from dips.node.follower import _initial_params
from dips.spec import RunConfig, RunSpec
from dips.spec.fingerprint import Fingerprint


def _spec(shapes: dict[str, list[int]]) -> RunSpec:
    cfg = RunConfig(followers=1)
    return RunSpec(config=cfg, layers=[("embed", list(shapes), 4)], follower_layers=[["embed"]],
                   eval_loss_initial=1.0, train_tokens=1, val_tokens=1, params=1,
                   windows_per_chunk=1,
                   fingerprint=Fingerprint(architecture={}, vocab_sha256="0" * 64,
                                           tensors=[(n, s, "float32") for n, s in shapes.items()]))


def test_a_checkpoint_directory_of_several_files_is_read_and_checked(tmp_path):
    a, b = torch.randn(3, 2), torch.randn(5)
    (tmp_path / "ckpt").mkdir()
    save_file({"a": a}, str(tmp_path / "ckpt" / "model-00001-of-00002.safetensors"))
    save_file({"b": b.to(torch.bfloat16)}, str(tmp_path / "ckpt" / "model-00002-of-00002.safetensors"))
    got = _initial_params(_spec({"a": [3, 2], "b": [5]}), ["a", "b"], tmp_path / "ckpt")
    assert torch.equal(got["a"], a) and got["b"].dtype == torch.float32
    with pytest.raises(RoleError, match=r"a has shape \(3, 2\), the run's model \(2, 3\)"):
        _initial_params(_spec({"a": [2, 3], "b": [5]}), ["a", "b"], tmp_path / "ckpt")
    with pytest.raises(RoleError, match=r"\['c'\] missing"):
        _initial_params(_spec({"a": [3, 2], "c": [1]}), ["a", "c"], tmp_path / "ckpt")
