"""dips.wire.ratelog: at most one line per key per interval (review 21, F3)."""

from __future__ import annotations

import logging

import pytest

from dips.wire.ratelog import OVERFLOW, RateLimitedLog, Tally


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def lines(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name]


def test_n_refusals_of_one_key_write_one_line_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    limited = RateLimitedLog(logging.getLogger("t.one"), 60.0, clock=clock)
    with caplog.at_level(logging.INFO, "t.one"):
        written = [limited.warning(("c", "BUSY"), "refused %s", i) for i in range(1000)]
        assert written == [True] + [False] * 999
        clock.t += 59.9
        assert not limited.warning(("c", "BUSY"), "refused %s", "late")
        clock.t += 0.1
        assert limited.warning(("c", "BUSY"), "refused %s", "next")
    assert lines(caplog, "t.one") == [
        "refused 0", "refused next (and 1000 more like it in the last 60 s)"]


def test_keys_are_limited_apart(caplog: pytest.LogCaptureFixture) -> None:
    limited = RateLimitedLog(logging.getLogger("t.two"), 60.0, clock=Clock())
    with caplog.at_level(logging.INFO, "t.two"):
        for _ in range(10):
            for key in (("a", "BUSY"), ("b", "BUSY"), ("a", "FORBIDDEN")):
                limited.info(key, "%s", key)
    assert len(lines(caplog, "t.two")) == 3


def test_many_keys_share_one_overflow_key(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    limited = RateLimitedLog(logging.getLogger("t.three"), 60.0, clock=clock, max_keys=8)
    with caplog.at_level(logging.INFO, "t.three"):
        for i in range(10_000):  # a peer that varies its key each time
            limited.warning(("key", i), "x %d", i)
        assert len(lines(caplog, "t.three")) == 8 + 1  # 8 keys, then one overflow line
        assert len(limited._keys) == 9 and OVERFLOW in limited._keys
        clock.t += 60.0  # the interval passed: old keys make room again
        assert limited.warning(("key", "new"), "fresh")
    assert len(limited._keys) <= 9


def test_a_disabled_level_costs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    limited = RateLimitedLog(logging.getLogger("t.four"), 60.0, clock=Clock())
    with caplog.at_level(logging.WARNING, "t.four"):
        assert not limited.debug("k", "hidden")
        assert limited.warning("k", "shown")  # the debug line took no slot
    assert lines(caplog, "t.four") == ["shown"]


@pytest.mark.parametrize("interval, keys", [(0.0, 1), (-1.0, 1), (1.0, 0)])
def test_bad_limits_are_refused(interval: float, keys: int) -> None:
    with pytest.raises(ValueError):
        RateLimitedLog(logging.getLogger("t"), interval, max_keys=keys)


def test_a_tally_counts_per_key_within_its_bound():
    tally = Tally(max_keys=3)
    for i in range(100):
        tally.add(("cluster-c", "RequestPush", "NOTHING_TRAINED"))
        tally.add(("member", i))  # keys beyond the bound share one
    counts = tally.counts()
    assert counts[("cluster-c", "RequestPush", "NOTHING_TRAINED")] == 100
    assert counts[OVERFLOW] == 98 and len(counts) == 3 + 1
    with pytest.raises(ValueError):
        Tally(0)
