"""A cluster's join waits for a live leader that says NOT_READY (a follower down or still
starting), however long that lasts, and gives up after ``timeout_s`` only without such an
answer (review 28 of issue 15, #3: a join refused while a follower is down must not make a
restarting cluster exit after ``timeouts.startup_s``)."""

from __future__ import annotations

import threading

import grpc
import pytest

from dips.algo.refusal import Refusal
from dips.train.dips_sync import DiPSSync
from dips.wire.control import REFUSAL_KEY

pytestmark = pytest.mark.timeout(30)


class _Err(grpc.RpcError):
    def __init__(self, refusal: Refusal | None) -> None:
        self.refusal = refusal

    def trailing_metadata(self):
        return () if self.refusal is None else ((REFUSAL_KEY, str(int(self.refusal))),)

    def code(self):
        return grpc.StatusCode.FAILED_PRECONDITION if self.refusal else grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return f"refused {self.refusal}"


class _Client:
    """A ClusterClient stand-in whose join() answers from a script."""

    cluster_id = "a"
    finished = ""

    def __init__(self, answers: list) -> None:
        self.answers = answers

    def join(self) -> int:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_not_ready_answers_are_waited_for_past_the_startup_time():
    client = _Client([_Err(Refusal.NOT_READY)] * 5 + [7])
    # No startup time at all: only the leader's "wait" answers keep the join going.
    assert DiPSSync(client).join(threading.Event(), timeout_s=-1.0, retry_s=0.0) == 7
    assert client.answers == []


def test_an_unreachable_leader_still_ends_the_join_after_its_time():
    client = _Client([_Err(Refusal.NOT_READY), _Err(None), 7])
    with pytest.raises(RuntimeError, match="join failed"):
        DiPSSync(client).join(threading.Event(), timeout_s=-1.0, retry_s=0.0)
    assert client.answers == [7]


def test_a_stop_ends_a_wait_for_followers():
    stop = threading.Event()
    stop.set()
    client = _Client([_Err(Refusal.NOT_READY), 7])
    with pytest.raises(RuntimeError, match="join failed"):
        DiPSSync(client).join(stop, timeout_s=60.0, retry_s=0.0)
