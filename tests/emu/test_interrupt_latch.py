"""A SIGINT whose exception a finaliser swallowed still stops `dips launch`.

Python raises a signal handler's exception in whichever frame runs when the signal is
checked. Once that frame was a regex cache's ``__del__`` during start-up: the interrupt was
only printed, the launcher went on waiting, and the leader, followers and clusters of the run
were left running after the test had given up on it. The launcher's wait loops now re-raise a
latched interrupt (:class:`dips.emu.children.InterruptLatch`).
"""

from __future__ import annotations

import signal
import sys

import pytest
from rich.console import Console

from dips.emu.children import Interrupted, InterruptLatch, Launch, wait_for
from dips.spec import ClusterConfig, RunConfig

pytestmark = pytest.mark.timeout(60)


class _SignalsInFinaliser:
    """Raises SIGINT from ``__del__``, where the handler's exception can only be printed."""

    def __del__(self) -> None:
        signal.raise_signal(signal.SIGINT)


@pytest.fixture
def run(tmp_path):
    launch = Launch(RunConfig(clusters=[ClusterConfig(id="a")]), tmp_path, Console(quiet=True))
    previous = signal.signal(signal.SIGINT, launch.interrupts.handler)
    yield launch
    signal.signal(signal.SIGINT, previous)
    for child in launch.children.values():
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait(10)


def test_an_interrupt_swallowed_by_a_finaliser_is_raised_at_the_next_wait(run):
    calls = []
    swallowed = []

    def cond():
        calls.append(1)
        if len(calls) == 1:
            hook, sys.unraisablehook = sys.unraisablehook, swallowed.append
            try:
                _SignalsInFinaliser()  # dropped at once: __del__ runs here
            finally:
                sys.unraisablehook = hook
        return False

    with pytest.raises(Interrupted, match="SIGINT"):
        wait_for(cond, 30.0, "never", run)
    # The handler's exception was swallowed in the finaliser, and the wait raised it anew.
    assert [type(u.exc_value) for u in swallowed] == [Interrupted]
    assert len(calls) == 1


def test_a_handled_interrupt_lets_the_clean_up_wait_to_its_end(run):
    with pytest.raises(Interrupted):
        run.interrupts.handler(signal.SIGTERM, None)
    run.interrupts.handled()
    assert wait_for(lambda: "done", 5.0, "clean-up", run) == "done"


def test_a_child_that_exits_early_is_named(run):
    run.spawn("follower-0", ["--no-such-flag"])
    with pytest.raises(RuntimeError, match="follower-0 exited early"):
        wait_for(lambda: False, 50.0, "followers registered", run)


def test_the_latch_is_idle_until_a_signal_comes():
    latch = InterruptLatch()
    latch.check()  # nothing pending: no exception
    with pytest.raises(Interrupted, match="SIGTERM"):
        latch.handler(signal.SIGTERM, None)
    with pytest.raises(Interrupted, match="SIGTERM"):
        latch.check()
    latch.handled()
    latch.check()
