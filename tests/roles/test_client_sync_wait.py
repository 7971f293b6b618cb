"""A sync whose verdict does not come records the time it waited for it (review 35 of
issue 15, F1): the leader frozen (SIGSTOP) for 4.2 s, every cluster's sync step said
``wait_s`` 0.0, and the report's timeline drew the 4.2 s as inner steps.

The leader client and the clock are stand-ins: the call "takes" 4.2 s of a fake clock, so
nothing depends on real time."""

from __future__ import annotations

import threading
import types

import pytest

from dips.roles import client_sync
from dips.roles.client_sync import PendingVerdict, SyncMixin
from dips.train.dips_sync import push_record
from dips.wire.control import CallCancelled
from tests.roles.test_client_hold import _Unavailable

pytestmark = pytest.mark.timeout(60)

WAITED_S = 4.2


class _Client(SyncMixin):
    """What :meth:`SyncMixin.resolve` uses of a cluster client, with a leader that answers
    nothing after ``WAITED_S`` seconds of the fake clock (raising ``error``)."""

    def __init__(self, clock: list[float], error: BaseException) -> None:
        self.cluster_id, self.version = "a", 3
        self._stop, self._rejoin = threading.Event(), threading.Event()
        self._pending_verdict = None
        self.failures: list[str] = []

        def push_done(*args, **kwargs):
            clock[0] += WAITED_S
            raise error

        self._leader = types.SimpleNamespace(PushDone=push_done)

    def _fail(self, reason: str) -> None:
        self.failures.append(reason)


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(client_sync, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    return now


@pytest.mark.parametrize("error,reason", [(_Unavailable(), "pending: UNAVAILABLE"),
                                          (CallCancelled(), "stopping")])
def test_a_verdict_that_does_not_come_records_the_wait(clock, error, reason):
    c = _Client(clock, error)
    res = c.resolve(PendingVerdict("p1", 7, 300, True, "", push_s=0.02), timeout_s=30.0)
    assert not res.ok and reason in res.reason
    assert res.wait_s == pytest.approx(WAITED_S)  # was 0.0
    assert push_record(res)["wait_s"] == pytest.approx(WAITED_S)  # what train.jsonl gets
    assert res.push_s == 0.02 and c._pending_verdict is not None  # kept, asked again later
