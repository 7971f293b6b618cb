"""A cluster killed (SIGKILL) after committed rounds and restarted resumes its inner AdamW
state and its data position (issue 14), against a real leader and follower (separate
processes, 127.0.0.1): the moments and step it runs with after the restart are those saved
at its last commit (compared with the file), it continues counting AdamW steps from there,
the data it trains on is the ledger's (the saved position is a hint the ledger confirms
when nothing was accepted since), and a corrupt state file is refused before the join."""

from __future__ import annotations

import pytest
import torch

from dips.roles.cluster_state import InnerStateStore, read_saved, state_digest

from .inner_run import (
    cluster,
    config,
    kill_all,
    kill_group,
    lines,
    pointer,
    resumed_and_saved_again,
    roles,
    wait,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.mark.long  # make test-long; the save and resume in one process: tests/roles/test_cluster_state.py
def test_a_killed_cluster_resumes_its_adamw_state_and_data_position(tmp_path):
    leader, procs = roles(tmp_path, config(tmp_path, {"id": "a"}))
    state, log = tmp_path / "a", tmp_path / "a.log"
    try:
        procs["a"] = cluster(leader, "a", state, log)
        first = wait("a committed round's inner state",
                     lambda: (p := pointer(state)) and p["version"] >= 1 and p, procs)
        kill_group(procs.pop("a"))
        first = pointer(state)  # the last one saved before the kill
        meta, saved = read_saved(state / "inner")
        assert meta["cluster_id"] == "a" and meta["mode"] == "one" and meta["step"] >= 1

        procs["a"] = cluster(leader, "a", state, log)
        resume, again = wait("the resumed cluster's next commit",
                             resumed_and_saved_again(state, first), procs)
        # The optimizer it trains with is the one in the file, step count included.
        assert resume["version"] == meta["version"] and resume["saved_step"] == meta["step"]
        assert resume["digest"] == state_digest(saved)
        assert resume["digest"]["step"] == meta["step"]
        assert resume["steps"] == meta["counters"]["steps"]
        # ... and AdamW went on counting from there (a fresh one would restart at 1).
        assert again["step"] == meta["step"] + again["counters"]["steps"] - meta["counters"]["steps"]
        # Data: the ledger's positions. With nothing accepted between the save and the
        # restart (one cluster: the version did not move), they are the saved ones.
        recs = lines(state / "train.jsonl")
        join = [r for r in recs if r.get("event") == "join"][-1]
        hint = {c: p for c, p in resume["data"]["hint"]}
        leased = {c: p for c, p in resume["data"]["leased"]}
        assert hint and resume["data"]["kept"] == sorted(c for c in hint if leased.get(c) == hint[c])
        if join["version"] == meta["version"]:
            assert resume["data"]["refused"] == [] and all(leased[c] == p for c, p in hint.items())
        else:  # pushes accepted after the save: the ledger moved on, never back
            assert all(leased[c] >= p for c, p in hint.items() if c in leased)

    finally:
        kill_all(procs)


def test_a_corrupt_state_file_is_refused_before_the_join_and_left_as_it_was(tmp_path):
    from dips.spec import load_config
    from dips.train.loop import make_inner_optimizer
    from dips.train.model import build_model

    cfg_path = config(tmp_path, {"id": "a"})
    cfg = load_config(cfg_path)
    model = build_model(cfg.model, cfg.seed)
    opt = make_inner_optimizer(model, cfg.inner.lr, cfg.inner.weight_decay)
    model(torch.zeros(1, 4, dtype=torch.long)).logits.sum().backward()
    opt.step()
    state = tmp_path / "a"
    path = InnerStateStore(state / "inner", "a", model, opt).save(
        3, {"held": [[0, 5]], "drain": False}, {"steps": 8, "tokens": 2048})
    raw = bytearray((path / "optimizer.safetensors").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (path / "optimizer.safetensors").write_bytes(bytes(raw))
    before = {p.name: p.read_bytes() for p in (state / "inner").rglob("*") if p.is_file()}
    leader, procs = roles(tmp_path, cfg_path, follower=False)  # refused before any join
    log = tmp_path / "a.log"
    try:
        procs["a"] = cluster(leader, "a", state, log)
        assert procs.pop("a").wait(180) == 2, log.read_text()[-2000:]
        text = log.read_text()
        assert "dips cluster: inner state" in text and "corrupt" in text, text[-2000:]
        assert {p.name: p.read_bytes() for p in (state / "inner").rglob("*")
                if p.is_file()} == before
        assert not lines(state / "train.jsonl")
        assert not [e for e in lines(tmp_path / "leader" / "leader_events.jsonl")
                    if e.get("event") == "cluster_joined"]
    finally:
        kill_all(procs)
