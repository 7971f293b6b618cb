"""The hold rule (dips.algo.hold; review 15, #2): when a cluster stops training until it can
sync again, and how long it waits before its next try."""

from __future__ import annotations

import pytest

from dips.algo.hold import POLL_S, Hold, hold

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
