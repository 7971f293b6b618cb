"""A rank's close waits for the transfer threads it gave up on (issue 14, fsdp2-abort).

Found in a full-suite run on a loaded 2-core machine: rank 1 of
tests/train/test_fsdp2_staging.py exited -6 (SIGABRT, "terminate called without an active
exception") after it had done and reported its work. A transfer that overran its deadline
is left running in a daemon thread (:func:`dips.roles.client_sync._in_threads`), and
:meth:`RankWorker.close` returned at once; the process then exited with that thread inside a
torch call, and the interpreter's shutdown aborts such a thread in C++ (``std::terminate``).
Now the rank keeps every thread it gave up on and ``close`` waits for them with a bound,
raising rather than exiting over one.

The stuck transfer is a stand-in stage worker whose push runs torch copies until the test
releases it (what a push to a dead follower does until its socket timeout); the checks read
whether its thread is alive and the child's exit status, never a duration. The child test
aborted on the old code (3 runs of 3); the sharded pull whose collective fails left its fetch
thread running there (3 of 3).
"""

from __future__ import annotations

import threading

import pytest
import torch

from dips.roles.client_sync import FOLLOWERS_CHANGED
from dips.roles.cluster_shards import LayerSlots, ShardedPull
from dips.roles.transfer_threads import Stragglers
from tests.roles.test_stage_ownership import PUSH, _worker, run_child

pytestmark = pytest.mark.timeout(60)


class BusyStage:
    """A stage worker whose push keeps copying tensors (inside torch, GIL released) until
    ``release``, then ``after`` more copies, and fails."""

    def __init__(self, after: int = 0) -> None:
        self.acked_bytes, self.after = 0, after
        self.entered, self.release = threading.Event(), threading.Event()
        self.thread: threading.Thread | None = None
        self._a, self._b = torch.zeros(1 << 18), torch.ones(1 << 18)

    def set_timeout(self, timeout_s: float) -> None:
        pass

    def push(self, *args, **kwargs) -> None:
        self.thread = threading.current_thread()
        self.entered.set()
        while not self.release.is_set():
            self._a.copy_(self._b)
        for _ in range(self.after):
            self._a.copy_(self._b)
        raise TimeoutError("no reply from the dead follower")

    def pull_layer(self, version, layer, follower, out) -> None:
        self.push()

    def close(self) -> None:
        self.closed_while_running = self.thread is not None and self.thread.is_alive() \
            and self.thread is not threading.current_thread()


class Releasing:
    """The fresh stage worker the rank opened after the overrun: closing it releases the
    stuck push (so the close that follows must wait for that push's thread)."""

    def __init__(self, stuck: BusyStage) -> None:
        self.stuck = stuck

    def close(self) -> None:
        self.stuck.release.set()


def _overrun(stuck: BusyStage):
    worker = _worker()
    worker.stage = stuck  # type: ignore[assignment]
    out = worker.run(PUSH, lambda: FOLLOWERS_CHANGED if stuck.entered.is_set() else None)
    assert out[0]["overran"], out
    worker.stage.close()  # type: ignore[union-attr]  (the fresh one, never used)
    return worker


def test_close_waits_for_the_transfer_thread_it_gave_up_on():
    stuck = BusyStage(after=200)
    worker = _overrun(stuck)
    worker.stage = Releasing(stuck)  # type: ignore[assignment]
    try:
        worker.close()
        assert stuck.thread is not None and not stuck.thread.is_alive(), \
            "close returned while the given-up transfer still ran"
    finally:
        stuck.release.set()


def test_close_fails_loudly_while_a_transfer_thread_still_runs():
    stuck = BusyStage()
    worker = _overrun(stuck)
    try:
        with pytest.raises(RuntimeError, match="1 transfer thread"):
            worker.close(timeout_s=0.1)
        assert stuck.thread is not None and stuck.thread.is_alive()
    finally:
        stuck.release.set()
    worker.close()
    assert not stuck.thread.is_alive()


def test_stragglers_join_the_threads_a_straggler_adds_meanwhile():
    kept, go = Stragglers(), threading.Event()
    inner = threading.Thread(target=go.wait, name="inner")

    def outer() -> None:
        go.wait()
        inner.start()
        kept.add([inner])

    t = threading.Thread(target=outer, name="outer")
    t.start()
    kept.add([t])
    go.set()
    kept.join(30)
    assert not t.is_alive() and not inner.is_alive()
    with pytest.raises(ValueError, match="timeout_s = -1"):
        kept.join(-1)


def test_a_sharded_pull_whose_collective_fails_waits_for_its_fetch(monkeypatch):
    """FSDP2: a collective of the main thread fails while the stage worker fetches; the
    error goes up only once the fetch thread ended (the old code left it running, and
    its stage worker open to the close that follows)."""
    stuck = BusyStage(after=2000)
    worker = _worker()
    worker.stage, worker.sharded = stuck, True  # type: ignore[assignment]
    worker.slots = LayerSlots(3, 4, torch.bfloat16)

    def load(pull: ShardedPull) -> bool:
        assert stuck.entered.wait(30)
        stuck.release.set()
        raise RuntimeError("a peer rank died (the collective failed)")

    monkeypatch.setattr(ShardedPull, "load", load)
    try:
        with pytest.raises(RuntimeError, match="peer rank died"):
            worker.run({"op": "pull", "version": 3, "limit": 30.0})
        assert stuck.thread is not None and not stuck.thread.is_alive(), \
            "the fetch thread still ran after the pull's error"
        worker.close()
        assert not getattr(stuck, "closed_while_running", False)
    finally:
        stuck.release.set()


def exit_after_a_given_up_push() -> None:
    """Child: a push overruns and is given up, the rank closes and the process exits."""
    stuck = BusyStage(after=2000)
    worker = _overrun(stuck)
    worker.stage = Releasing(stuck)  # type: ignore[assignment]
    worker.close()
    print("ok", flush=True)


@pytest.mark.timeout(120)
def test_a_rank_never_exits_over_a_transfer_thread_inside_torch():
    run_child("test_rank_close", "exit_after_a_given_up_push()")
