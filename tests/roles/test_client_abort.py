"""A cluster never waits on a dead follower or past its own stop (issue 10).

Found by a fresh review: a cluster on a slow link had a push in flight when a follower was
killed; its transfer deadline came from its measured (slow) pushes, so its training stood
still for the rest of the run and it ignored SIGTERM until killed. Now every transfer is given
up as soon as the leader's ``followers_epoch`` changes (a follower marked down or registered
as a new incarnation) or the process is asked to stop, and a verdict or admission wait is
cancelled by a stop.

The dead follower is a data server the test stops: a push to it is queued by ZeroMQ and never
answered, so without the abort the transfer would wait its whole deadline (60 s here). No
assertion depends on timing: each checks *why* the transfer ended.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest

from dips.algo.refusal import Refusal
from dips.roles.client_sync import FOLLOWERS_CHANGED, StageFailures
from tests.roles.test_protocol import Run, _perturb, _wait_until

pytestmark = pytest.mark.timeout(120)


def _spy_pushes(client) -> list[StageFailures | None]:
    """Record how each run of the stage workers ended (None: delivered): the typed
    StageFailures, so the checks read codes and the client's own reason, not messages."""
    seen: list[StageFailures | None] = []
    real = client._guard

    def guard(failures):
        seen.append(failures)
        return real(failures)

    client._guard = guard
    return seen


def _push_in_thread(client) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def go():
        client.step_done(100)
        out["result"] = client.step_done(100)  # H = 2: this one syncs

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, out


def test_a_follower_restarted_mid_push_aborts_the_transfer(tmp_path):
    run = Run(tmp_path)
    try:
        c = run.client("a")
        c.join()
        _wait_until(lambda: c._followers_epoch is not None, "a first heartbeat")
        seen = _spy_pushes(c)
        run.servers[1].stop()  # follower 1's data plane dies: pushes to it are never answered
        _perturb(c.model, seed=3)
        thread, out = _push_in_thread(c)
        _wait_until(lambda: run.admitted.get("a"), "the push admitted")
        # Follower 1 comes back as a new incarnation (the supervisor restarted it).
        run.entries[1] = dataclasses.replace(run.entries[1], incarnation=1)
        run.leader.register_follower(run.entries[1])
        thread.join(90)
        assert not thread.is_alive(), "the sync never returned"
        # Given up for the restart: seen by the client (the leader's followers_epoch), or by the
        # surviving follower, which the leader told to drop the round the restart failed, while
        # or before a layer arrived (whichever reaches the client first); never by waiting
        # out the transfer deadline.
        assert seen and seen[0] is not None, seen
        assert (seen[0].aborted == FOLLOWERS_CHANGED
                or Refusal.STALE_GRANT in seen[0].refusals()), str(seen[0])
        assert not out["result"].accepted, out["result"]
        c.close()
    finally:
        run.close()


def test_a_stop_request_ends_a_stalled_push_and_its_verdict_wait(tmp_path):
    run = Run(tmp_path)
    stop = threading.Event()
    try:
        c = run.client("a")
        c._stop = stop  # what `dips launch`'s cluster process passes as ``stop=``
        c.join()
        seen = _spy_pushes(c)
        run.servers[1].stop()
        _perturb(c.model, seed=4)
        thread, out = _push_in_thread(c)
        _wait_until(lambda: run.admitted.get("a"), "the push admitted")
        stop.set()  # SIGTERM in a cluster process
        thread.join(90)
        assert not thread.is_alive(), "the sync never returned"
        assert seen and seen[0] is not None and seen[0].aborted == "stopping", seen
        assert out["result"].reason == "stopping", out["result"]
        assert c._pending_verdict is not None  # asked again by push id, never guessed
        c.close(leave=False)
    finally:
        run.close()
