"""A stage worker is closed only by the thread that runs its transfer (review 31 of issue 14).

Found by a fresh review: with torchrun clusters, killing a follower mid-push made rank 0 of
a pipeline cluster abort in libzmq (``Assertion failed: pfd.revents & POLLIN``) and rank 0
of a DDP cluster segfault; a one-process cluster held and retried. The push was given up
(``followers_epoch`` moved) while rank 0's stage thread was still blocked on the dead
follower's socket, and :meth:`RankWorker._transfer` then re-connected by *closing* that stage
worker's sockets from the main thread. Now a stage worker whose transfer overran belongs to
its transfer's thread, which closes it when the transfer returns; the rank drops it and opens
a fresh one.

The stuck transfer is a stand-in stage worker whose push blocks until the test releases it
(what a push to a dead follower does until its socket timeout); each check reads which
thread closed it and whether its push was still running, never a duration. The last test
does it with real sockets, in a child process (the old code aborted it in libzmq, as in the
review, 3 runs of 3).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from dips.roles.client_sync import FOLLOWERS_CHANGED, _in_threads
from dips.roles.cluster import StageWorker
from dips.roles.cluster_ranks import RankWorker

pytestmark = pytest.mark.timeout(60)


class OneRank:
    """The control group of a one-rank cluster (gather returns this rank's outcome)."""

    rank, world, timeout_s = 0, 1, 120.0

    def gather(self, obj):
        return [obj]


class StuckStage:
    """A stage worker whose transfer blocks until ``release`` (a dead follower)."""

    def __init__(self) -> None:
        self.acked_bytes = 0
        self.entered, self.release, self.closed = (threading.Event() for _ in range(3))
        self.running = False
        self.transfer_thread: threading.Thread | None = None
        self.closed_by: threading.Thread | None = None
        self.closed_while_running: bool | None = None

    def set_timeout(self, timeout_s: float) -> None:
        pass

    def _block(self) -> None:
        self.transfer_thread = threading.current_thread()
        self.running = True
        self.entered.set()
        self.release.wait(30)
        self.running = False
        raise TimeoutError("no reply from the dead follower")

    def push(self, *args, **kwargs) -> None:
        self._block()

    def pull(self, version, owner):
        self._block()

    def close(self) -> None:
        self.closed_by = threading.current_thread()
        self.closed_while_running = self.running
        self.closed.set()


def _worker() -> RankWorker:
    layers = [("l0", [("l0.w", torch.nn.Parameter(torch.zeros(4)))])]
    w = RankWorker(OneRank(), layers, [range(0, 1)], verify=False)
    w.connect({"op": "connect", "key_id": "k", "key": (b"\x01" * 32).hex(), "encrypt": False,
               "timeout_s": 5.0, "endpoints": {"0": "tcp://127.0.0.1:9"}, "owner": {"l0": 0}})
    return w


PUSH = {"op": "push", "cluster": "c", "round": 1, "push_id": "p", "plans": [[("l0", 0)]],
        "tokens": 1, "stage_first": False, "limit": 30.0, "ticket": None, "ticket_mac": ""}


@pytest.mark.parametrize("cmd", [PUSH, {"op": "pull", "version": 3, "limit": 30.0}],
                         ids=["push", "pull"])
def test_a_rank_never_closes_the_stage_worker_of_a_transfer_it_gave_up(cmd):
    worker = _worker()
    stuck = StuckStage()
    worker.stage = stuck  # type: ignore[assignment]
    try:
        out = worker.run(cmd, lambda: FOLLOWERS_CHANGED if stuck.entered.is_set() else None)
        assert out[0]["overran"] and out[0]["aborted"] == FOLLOWERS_CHANGED, out
        # Not closed under the blocked transfer (the old code did, from this thread) ...
        assert stuck.closed_while_running is None, "closed while its transfer still ran"
        # ... and replaced by a fresh stage worker for the next command.
        assert isinstance(worker.stage, StageWorker) and worker.stage is not stuck
        stuck.release.set()
        assert stuck.closed.wait(30), "the abandoned stage worker was never closed"
        assert stuck.closed_by is stuck.transfer_thread and not stuck.closed_while_running
    finally:
        stuck.release.set()
        worker.close()


class Closable:
    def __init__(self) -> None:
        self.closed = threading.Event()
        self.closed_by: threading.Thread | None = None

    def close(self) -> None:
        self.closed_by = threading.current_thread()
        self.closed.set()


def test_in_threads_hands_what_an_overrunning_job_uses_to_its_thread():
    release, entered = threading.Event(), threading.Event()
    threads: dict[str, threading.Thread] = {}

    def stuck() -> None:
        threads["stuck"] = threading.current_thread()
        entered.set()
        release.wait(30)

    done, hung = Closable(), Closable()
    try:
        failures = _in_threads([lambda: None, stuck], 30.0,
                               lambda: "given up" if entered.is_set() else None, [done, hung])
        assert failures is not None and failures.overran and failures.aborted == "given up"
        assert not hung.closed.is_set()  # still in use by its thread
        release.set()
        assert hung.closed.wait(30) and hung.closed_by is threads["stuck"]
        assert not done.closed.is_set()  # finished in time: still the caller's
    finally:
        release.set()


def abandon_real_pushes(n: int) -> None:
    """In a child process: ``n`` pushes of a real stage worker to a follower that never
    answers (a bound ROUTER), each given up once its first frames arrived there; then wait
    until every stuck transfer thread has ended (closing its own sockets) and print ok."""
    import zmq

    ctx = zmq.Context.instance()
    dead = ctx.socket(zmq.ROUTER)  # the test's thread's socket only (abandon runs here)
    port = dead.bind_to_random_port("tcp://127.0.0.1")
    layers = [(f"l{i}", [(f"l{i}.w", torch.nn.Parameter(torch.randn(20000)))])
              for i in range(4)]
    w = RankWorker(OneRank(), layers, [range(0, 4)], verify=False)
    w.connect({"op": "connect", "key_id": "k", "key": (b"\x01" * 32).hex(), "encrypt": False,
               "timeout_s": 5.0, "endpoints": {"0": f"tcp://127.0.0.1:{port}"}, "owner": {}})
    for k in range(n):
        while dead.poll(0):
            dead.recv_multipart()
        out = w.run({**PUSH, "round": k, "push_id": f"p{k}", "limit": 3.0,
                     "plans": [[(f"l{i}", 0) for i in range(4)]]},
                    lambda: FOLLOWERS_CHANGED if dead.poll(0) else None)
        assert out[0]["overran"], out
    while threading.active_count() > 1:  # the stuck threads reach their socket timeouts
        threading.Event().wait(0.05)
    w.close()
    dead.close(0)
    print("ok", flush=True)


def run_child(module: str, call: str) -> None:
    """Run ``call`` (a function of test ``module``, which prints "ok") in a child process;
    asserts it printed "ok" and exited 0 (an abort in libzmq or torch shows as its signal)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.run(
        [sys.executable, "-c", f"from tests.roles.{module} import {call.split('(')[0]}; {call}"],
        env=env, capture_output=True, text=True, timeout=100)
    assert child.returncode == 0 and child.stdout.strip() == "ok", (child.returncode,
                                                                    child.stderr[-2000:])


@pytest.mark.timeout(120)
def test_real_pushes_given_up_mid_stream_never_crash_the_rank():
    run_child("test_stage_ownership", "abandon_real_pushes(5)")
