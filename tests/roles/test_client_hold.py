"""A cluster that cannot sync holds instead of training on (review 15, #2; dips.algo.hold).

Found by a review: after a ~30 s leader outage each cluster's next push carried the whole
outage's training and the penalty rejected it (its data rewound, the work redone), or a lost
push's re-join threw it away. Now a cluster trains at most ``hold_after`` sync intervals past
its last completed sync, and not at all while a verdict or a re-join is pending; then it keeps
its model and data position and tries again until the sync completes.

The outage is the client's cut link (:func:`dips.roles.failpoints.link_down`, as ``dips
launch``'s ``cut_link`` emulates it on loopback: every call of the cluster fails). No assertion
depends on timing: a hold can only end once the link is back, which the test decides.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from dips.roles import failpoints
from tests.roles.test_protocol import Run, _perturb

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cut(tmp_path, monkeypatch):
    """Switch for this process's emulated link: ``cut(True)`` cuts it, ``cut(False)`` heals."""
    monkeypatch.setattr(failpoints, "_DIR", str(tmp_path))
    monkeypatch.setattr(failpoints, "_NAME", "cluster-a")
    flag = tmp_path / "cluster-a.link_down"

    def switch(down: bool) -> None:
        if down:
            flag.write_text("")
        else:
            flag.unlink(missing_ok=True)
    return switch


def test_a_cluster_holds_after_its_interval_until_the_sync_completes(tmp_path, cut):
    run = Run(tmp_path / "run")
    try:
        c = run.client("a")  # H = 2, hold_after = 1 (the default)
        c.join()
        cut(True)
        c.step_done(100, wait=False)
        failed = c.step_done(100, wait=False)  # the H-th step: its sync fails (link down)
        assert not failed.ok and c.held().reason == "sync overdue"
        go, start = c.hold_tick()
        assert not go and start.kind == "hold" and start.steps_since_sync == 2
        assert start.last_failure == "link down"
        assert c.hold_tick() == (False, None)  # still cut: no training, and it tried again
        # A user's own loop: step_done (wait=True) returns only once the sync went through.
        _perturb(c.model, seed=4)
        out: dict = {}
        worker = threading.Thread(target=lambda: out.update(r=c.wait_while_held()), daemon=True)
        worker.start()
        assert c.holding and worker.is_alive()  # cut: the hold cannot end
        cut(False)
        worker.join(90)
        assert not worker.is_alive() and out["r"].ok and out["r"].accepted
        assert c.inner_step == 2 and c.version == 1  # nothing trained while it held
        assert out["r"].tokens == 200  # the push carries its one interval, not more
        assert c.held() is None and c.hold_tick() == (True, None)
        c.close()
    finally:
        run.close()


def test_hold_after_none_trains_on_through_the_outage(tmp_path, cut):
    run = Run(tmp_path / "run")
    try:
        c = run.client("a")
        c.hold_after = None  # the behaviour before: never hold
        c.join()
        cut(True)
        for _ in range(6):
            c.step_done(100)  # returns at once: no hold
        assert c.held() is None and c.hold_tick() == (True, None) and c.inner_step == 6
        c.close(leave=False)
    finally:
        run.close()


class _Unavailable(grpc.RpcError):
    """A call that found no leader (what gRPC raises when the connection is gone)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the leader is gone"

    def trailing_metadata(self) -> tuple:
        return ()


class _VerdictLost:
    """The cluster's leader client, whose first PushDone fails as if the leader were gone."""

    def __init__(self, inner) -> None:
        self.inner, self.failed = inner, 0

    def __getattr__(self, name: str):
        if name == "PushDone" and not self.failed:
            self.failed += 1

            def fail(*args, **kwargs):
                raise _Unavailable()
            return fail
        return getattr(self.inner, name)


def test_a_pending_verdict_holds_at_once_and_the_verdict_ends_it(tmp_path):
    """The push went through but its verdict could not be fetched: whatever the cluster
    trained now would be thrown away when the verdict comes, so it holds at once, and asking
    again for the verdict ends the hold."""
    run = Run(tmp_path / "run")
    try:
        c = run.client("a")
        c.join()
        c._leader = flaky = _VerdictLost(c._leader)
        _perturb(c.model, seed=5)
        c.step_done(100, wait=False)
        res = c.step_done(100, wait=False)
        assert flaky.failed and not res.ok and c._pending_verdict is not None
        assert c.held().reason == "verdict pending"
        go, start = c.hold_tick()
        assert not go and start.reason == "verdict pending"
        assert c.wait_while_held() is not None  # the verdict, asked again
        assert c._pending_verdict is None and c.version == 1 and c.inner_step == 2
        assert c.held() is None
        c.close()
    finally:
        run.close()
