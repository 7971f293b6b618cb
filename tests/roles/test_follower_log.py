"""A follower's ``applied.jsonl`` stays a true history across process restarts (found by the
fault tests: a follower killed before its asynchronous checkpoint of version 21 restarted from
version 20 and then applied a new version 21; its log showed 21 twice and the followers
seemed to disagree)."""

from __future__ import annotations

import json

import torch

from dips.roles.follower import FollowerShard
from tests.integration.invariants import effective_history


def _shard(log_dir, version: int) -> FollowerShard:
    return FollowerShard(0, {"w": ["w"]}, {"w": torch.zeros(4)}, log_dir=log_dir,
                         version=version)


def test_a_restart_from_an_older_checkpoint_is_logged_as_a_restore(tmp_path):
    _shard(tmp_path, 0)
    assert not (tmp_path / "applied.jsonl").exists()  # a fresh start writes nothing
    log = tmp_path / "applied.jsonl"
    log.write_text("".join(json.dumps({"version": v, "round": v}) + "\n" for v in (1, 2, 3)))
    _shard(tmp_path, 2)  # the process restarts from its checkpoint of version 2
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert lines[-1]["event"] == "restore" and lines[-1]["version"] == 2
    assert lines[-1]["cause"] == "process start"
    assert [h["version"] for h in effective_history(lines)] == [1, 2]
