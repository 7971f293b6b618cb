"""A stalled inner step ends a torchrun cluster (review 14, F1: a SIGSTOPped rank held its
cluster for the 1800 s collective timeout while rank 0 kept it a member). The bound by hand,
and the watch on a fake clock: a step that overruns calls ``on_stall`` once, a normal one
never."""

from __future__ import annotations

import threading

import pytest

from dips.node.stepwatch import StepWatch, step_bound

pytestmark = pytest.mark.timeout(30)


def test_the_bound_is_the_first_step_allowance_then_a_multiple_of_the_median():
    assert step_bound([], 20, 60, 600, 3) == 600
    assert step_bound([1.0, 1.0], 20, 60, 600, 3) == 600  # still warming up
    assert step_bound([1.0, 2.0, 9.0], 20, 60, 600, 3) == 60  # 20 x 2 s < the 60 s floor
    assert step_bound([5.0, 4.0, 6.0, 100.0], 20, 60, 600, 3) == pytest.approx(110.0)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_step_over_its_bound_calls_on_stall_once_and_a_normal_one_never():
    clock, stalls = Clock(), []
    watch = StepWatch(factor=20, floor_s=60, first_s=600, warmup=3, poll_s=3600,
                      on_stall=stalls.append, clock=clock)
    inside, release = threading.Event(), threading.Event()

    def step(seconds: float, block: bool = False) -> str:
        clock.t += seconds
        if block:
            inside.set()
            release.wait(10)
        return "done"

    timed = watch.wrap(step)
    for _ in range(3):
        assert timed(2.0) == "done"  # three steps of 2 s: the bound is now 60 s
    assert watch.check() is None and stalls == []
    t = threading.Thread(target=timed, args=(0.0, True))
    t.start()
    assert inside.wait(10)
    clock.t += 59.0
    assert watch.check() is None  # within the bound
    clock.t += 2.0
    message = watch.check()
    assert message is not None and "an inner step has run 61 s, over its bound of 60 s" in message
    assert stalls == [message]
    clock.t += 100.0
    assert watch.check() is None and len(stalls) == 1  # once
    release.set()
    t.join(10)
    watch.close()


def test_a_per_step_collective_is_bounded_too_and_does_not_make_the_median():
    """Review 24, F1: rank 1 stopped while it paced held rank 0 in the broadcast that ends a
    step's commands, outside the timed step, until the 1800 s collective timeout."""
    clock, stalls = Clock(), []
    watch = StepWatch(factor=20, floor_s=60, first_s=600, warmup=3, poll_s=3600,
                      on_stall=stalls.append, clock=clock)
    inside, release = threading.Event(), threading.Event()

    def step() -> None:
        clock.t += 2.0

    def end(block: bool = False) -> None:
        clock.t += 0.001
        if block:
            inside.set()
            release.wait(10)

    timed_step, timed_end = watch.wrap(step), watch.wrap(end, "the end of a step", record=False)
    for _ in range(3):
        timed_step()
        timed_end()
    assert list(watch.recent) == pytest.approx([2.0] * 3)  # the collectives are no steps
    t = threading.Thread(target=timed_end, args=(True,))
    t.start()
    assert inside.wait(10)
    clock.t += 59.0
    assert watch.check() is None
    clock.t += 2.0
    message = watch.check()
    assert message is not None and message.startswith("the end of a step has run 61 s, over its "
                                                      "bound of 60 s")
    assert stalls == [message]
    release.set()
    t.join(10)
    watch.close()


def test_the_bound_is_a_cluster_setting_checked_by_name():
    """``stall_factor`` and ``stall_floor_s`` of a cluster's entry are what rank 0's watch
    takes (tests/node/test_stepwatch_sigstop.py runs one with a 5 s floor); a bad value is
    refused naming the field."""
    from pydantic import ValidationError

    from dips.spec import ClusterConfig

    me = ClusterConfig(id="a", stall_floor_s=5, stall_factor=10)
    assert (me.stall_floor_s, me.stall_factor) == (5.0, 10.0)
    assert (ClusterConfig(id="a").stall_floor_s, ClusterConfig(id="a").stall_factor) == (60.0, 20.0)
    for field, value in (("stall_floor_s", 0.5), ("stall_factor", 0.9), ("stall_floor_s", "inf")):
        with pytest.raises(ValidationError, match=field):
            ClusterConfig(id="a", **{field: value})
