"""The leader process's state directory and lease taking (dips.node.leader), without gRPC."""

from __future__ import annotations

import stat
import threading

import grpc
import pytest

from dips.algo.refusal import Refusal
from dips.node.common import RoleError, StateDir
from dips.algo.fencing import starts_of
from dips.node.leader import data_secret, load_or_prepare, next_term, take_leases
from dips.spec import RunConfig, RunSpec
from dips.wire.control import REFUSAL_KEY


def test_each_start_takes_a_higher_unique_term_and_keeps_one_secret(tmp_path):
    terms = [next_term(tmp_path) for _ in range(3)]
    assert [starts_of(t) for t in terms] == [1, 2, 3] and terms == sorted(terms)
    assert (tmp_path / "term").read_text().strip() == "3"
    copy = tmp_path / "copy"
    copy.mkdir()
    again = set()
    for _ in range(8):  # copies of one state directory: the same start count each time
        (copy / "term").write_text("3\n")
        again.add(next_term(copy))
    assert len(again) == 8 and all(starts_of(t) == 4 for t in again)  # never the same term
    s = data_secret(tmp_path)
    assert len(s) == 32 and data_secret(tmp_path) == s
    assert stat.S_IMODE((tmp_path / "data_secret").stat().st_mode) == 0o600


def test_a_state_dir_prepared_for_another_config_is_refused(tmp_path):
    cfg = RunConfig(followers=1)
    RunSpec(config=cfg, layers=[("embed", ["w"], 4)], follower_layers=[["embed"]],
            eval_loss_initial=1.0, train_tokens=1, val_tokens=1, params=1,
            windows_per_chunk=1).write(tmp_path / "run.json")
    assert load_or_prepare(cfg, tmp_path, None).config == cfg
    with pytest.raises(RoleError, match=r"fields \['seed'\] differ"):
        load_or_prepare(cfg.model_copy(update={"seed": 1}), tmp_path, None)


def test_a_state_dir_is_held_by_one_process_for_its_life(tmp_path):
    import gc

    StateDir(tmp_path).acquire()  # as the role processes call it: the result is not kept
    gc.collect()
    with pytest.raises(RoleError, match="in use by another dips process"):
        StateDir(tmp_path).acquire()
    from dips.node import common

    common._HELD.pop().close()  # what exiting does
    StateDir(tmp_path).acquire().release()


class _Refusal(grpc.RpcError):
    def __init__(self, code: Refusal | None) -> None:
        self.refusal = code

    def trailing_metadata(self):
        return () if self.refusal is None else ((REFUSAL_KEY, str(int(self.refusal))),)

    def details(self) -> str:
        return f"refused {self.refusal}"


class _Control:
    """A follower's control client whose fence() answers from a script."""

    def __init__(self, answers: list) -> None:
        self.answers = answers

    def fence(self, version: int = 0) -> int:
        a = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(a, Exception):
            raise a
        return a

    def close(self) -> None:
        pass


def test_take_leases_waits_out_a_dead_leader_and_steps_down_for_a_live_one():
    stop = threading.Event()
    held, stale = _Refusal(Refusal.LEASE_HELD), _Refusal(Refusal.STALE_TERM)
    scripts = {0: _Control([held, held, 5]), 1: _Control([_Refusal(None)])}  # 1: unreachable
    assert take_leases({0: "a", 1: "b"}, lambda i, ep: scripts[i], 0.2, stop) is None
    scripts = {0: _Control([held])}  # renewed by a live leader, forever
    assert "stays leased to another live leader" in take_leases({0: "a"}, lambda i, ep: scripts[i], 0.2, stop)
    scripts = {0: _Control([stale])}
    assert "follower 0" in take_leases({0: "a"}, lambda i, ep: scripts[i], 0.2, stop)
