"""Tests of the fixed grace window (§6, §7, §11 of the seed)."""

from __future__ import annotations

import math

import pytest

from dips.algo.window import FixedGraceWindow


def test_seed_section_11_window():
    # A at 100 s opens an 8 s window; B (103 s) and C (106 s) join, D (180 s) does not.
    close = FixedGraceWindow(8.0).close_time(100.0)
    assert close == 108.0
    assert [t <= close for t in (103.0, 106.0, 180.0)] == [True, True, False]


def test_zero_window_closes_at_once():
    assert FixedGraceWindow(0.0).close_time(5.5) == 5.5
    assert FixedGraceWindow(3).close_time(-2.0) == 1.0


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, "8", True])
def test_bad_seconds(bad):
    with pytest.raises(ValueError, match="seconds.*" + repr(bad).replace("'", ".")):
        FixedGraceWindow(bad)


@pytest.mark.parametrize("bad", [math.nan, math.inf, None])
def test_bad_opened_at(bad):
    with pytest.raises(ValueError, match="opened_at.*" + repr(bad)):
        FixedGraceWindow(8.0).close_time(bad)


def test_frozen():
    window = FixedGraceWindow(8.0)
    with pytest.raises(AttributeError):
        window.seconds = 1.0  # type: ignore[misc]
