"""The hold rule (dips.algo.hold; review 15, #2): when a cluster stops training until it can
sync again, and how long it waits before its next try; a push request's admission deadline
and the backoff (issue 16)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dips.algo.hold import (BACKOFF_FIRST_S, BACKOFF_MAX_S, POLL_S, Admission, Hold, admission,
                            hold, next_backoff)
from dips.algo.round import PushRequested, PushWithdrawn, RoundPolicy, RoundState, Tick, step
from dips.spec.protocol import GraceConfig

NOW = 100.0


def ask(steps: int, hold_after: int | None = 1, *, rejoin: bool = False, verdict: bool = False,
        retry_at: float = 0.0) -> Hold | None:
    return hold(steps, 8, hold_after, rejoin_pending=rejoin, verdict_pending=verdict, now=NOW,
                retry_at=retry_at)


def test_a_cluster_trains_until_it_is_hold_after_intervals_past_its_last_sync():
    assert ask(0) is None and ask(7) is None  # within its interval: train
    assert ask(8) == Hold("sync overdue", 0.0, 8)  # H steps and no sync completed: hold
    assert ask(15, hold_after=2) is None and ask(16, hold_after=2).reason == "sync overdue"
    assert ask(10_000, hold_after=None) is None  # never holds


def test_a_pending_verdict_or_re_join_holds_at_once_whatever_was_trained():
    """What it would train meanwhile is thrown away when the verdict comes (it goes on from
    the ledger's positions) or by the re-join (one complete model pulled)."""
    assert ask(0, verdict=True) == Hold("verdict pending", 0.0, 0)
    assert ask(3, rejoin=True, verdict=True) == Hold("re-join pending", 0.0, 3)
    assert ask(0, hold_after=None, rejoin=True) is None


def test_the_wait_is_the_backoff_left_at_most_one_poll():
    assert ask(8, retry_at=NOW + 0.25).wait_s == 0.25
    assert ask(8, retry_at=NOW + 30.0).wait_s == POLL_S  # looks again within a second
    assert ask(8, retry_at=NOW - 5.0).wait_s == 0.0  # the backoff is over: try now


@pytest.mark.parametrize("kwargs, names", [
    ({"steps_since_sync": -1}, "steps_since_sync = -1"),
    ({"H": 0}, "H = 0"),
    ({"hold_after": 0}, "hold_after = 0"),
    ({"hold_after": True}, "hold_after = True"),
    ({"now": float("nan")}, "now = nan"),
    ({"poll_s": 0.0}, "poll_s = 0.0"),
])
def test_bad_input_is_refused_naming_the_argument_and_value(kwargs, names):
    args = {"steps_since_sync": 8, "H": 8, "hold_after": 1, "rejoin_pending": False,
            "verdict_pending": False, "now": NOW, "retry_at": 0.0, **kwargs}
    with pytest.raises(ValueError, match=names.replace("(", r"\(")):
        hold(**args)


# ----- a push request's admission deadline and the backoff (issue 16) -----
def _round(window_s=1.0):
    return RoundPolicy(GraceConfig(window_s=window_s), 60.0, 60.0)


def test_a_request_is_admitted_sent_ahead_waiting_or_withdrawn_at_its_deadline():
    pol = _round()
    s, _ = step(RoundState(), PushRequested(0.0, "a", "pa", 0, 10), pol)
    assert admission(s, "a", "pa", 30.0, 0.0).what is Admission.ADMITTED  # opened the window
    s, _ = step(s, Tick(1.0), pol)  # the window closes: b's request waits for the next round
    s, _ = step(s, PushRequested(2.0, "b", "pb", 0, 10), pol)
    w = admission(s, "b", "pb", 32.0, 2.0)
    assert (w.what, w.slot.push_id, w.left_s) == (Admission.WAITING, "pb", 30.0)
    assert admission(s, "b", "pb", 32.0, 32.0).what is Admission.WITHDRAW  # at the deadline
    assert admission(s, "b", "pb", 32.0, 40.0) == (Admission.WITHDRAW, w.slot, 0.0)
    s, _ = step(s, PushWithdrawn(32.0, "b", "pb"), pol)
    assert admission(s, "b", "pb", 32.0, 32.0) == (Admission.DROPPED, None, 0.0)
    assert admission(s, "a", "other", 32.0, 32.0).what is Admission.DROPPED  # not its push
    with pytest.raises(ValueError, match="deadline_s"):
        admission(s, "b", "pb", float("nan"), 0.0)


def test_a_request_sent_ahead_and_one_of_a_finished_run():
    s, _ = step(RoundState(), PushRequested(0.0, "a", "pa", 0, 10), _round())
    slot = s.current.slots["a"]
    ahead = replace(s, current=None, staging={"a": replace(slot, round=None)})
    assert admission(ahead, "a", "pa", 30.0, 99.0).what is Admission.SENT_AHEAD
    done = replace(RoundState(), finished="token budget")
    assert admission(done, "a", "pa", 30.0, 0.0) == (Admission.FINISHED, None, 0.0)


def test_the_backoff_doubles_from_half_a_second_to_ten():
    waits, b = [], BACKOFF_FIRST_S
    for _ in range(7):
        waits.append(b)
        b = next_backoff(b)
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0] and BACKOFF_MAX_S == 10.0
    for bad in (0, -1.0, float("inf"), "1"):
        with pytest.raises(ValueError, match="backoff_s"):
            next_backoff(bad)
