"""A transfer that overran its deadline says which follower did not answer (review 32 of
issue 14): after a follower kill every cluster's pull failed with "stage workers still
running after 2.06 s", which read as old workers blocking the new pull; it was the transfer
to the down follower that timed out. Now: "stage 0: no reply from follower 1 within 2.06 s".

The stuck transfers block until the test releases them (a follower that never answers), so
every deadline passes whatever its length: nothing here depends on timing."""

from __future__ import annotations

import threading

import pytest
import torch
import zmq

from dips.roles.client_sync import _in_threads
from dips.roles.cluster import StageWorker
from dips.wire.keys import MemberKey

pytestmark = pytest.mark.timeout(60)


class Waiting:
    """What a stage worker stuck on follower ``f`` looks like to its caller."""

    def __init__(self, f: int | None) -> None:
        self.waiting_on = f

    def close(self) -> None:
        pass


def test_an_overrun_names_the_follower_each_stage_waited_for():
    release = threading.Event()
    try:
        failures = _in_threads([lambda: None, lambda: release.wait(30), lambda: release.wait(30)],
                               0.05, None, [Waiting(0), Waiting(1), Waiting(None)])
        assert failures is not None and failures.overran
        assert str(failures) == ("stage 1: no reply from follower 1 within 0.05 s; "
                                 "stage 2: still running after 0.05 s")
    finally:
        release.set()


def test_a_stage_worker_pulling_from_a_silent_follower_waits_on_it():
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # receives, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    layers = {"l0": [("l0.w", torch.nn.Parameter(torch.zeros(8)))]}
    stage = StageWorker(0, layers, MemberKey("cluster-a/" + "0" * 32, b"\x01" * 32, False),
                        {3: f"tcp://127.0.0.1:{port}"}, timeout_s=2.0)  # then it closes itself
    seen: list[int | None] = []
    try:
        def seen_waiting() -> str | None:  # abandon once the pull waits for its reply
            if silent.poll(0):
                seen.append(stage.waiting_on)
                return "the test saw the request"
            return None

        failures = _in_threads([lambda: stage.pull(5, {"l0": 3})], 30.0, seen_waiting, [stage])
        assert seen == [3] and failures is not None and failures.aborted
    finally:
        silent.close(linger=0)
