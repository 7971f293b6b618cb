"""dips.node.attempt (issue 14): the store prefix of each torchrun attempt, and a bad
``TORCHELASTIC_RESTART_COUNT`` refused naming it. The restart itself, end to end:
tests/node/test_torchrun_restart.py."""

from __future__ import annotations

import pytest

from dips.node.attempt import attempt_prefix, restart_count


def test_each_attempt_has_its_own_prefix(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert restart_count() == 0  # no torchrun, or its first start
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert restart_count() == 2
    assert len({attempt_prefix(n) for n in range(3)}) == 3


@pytest.mark.parametrize("raw", ["-1", "x", "1.5"])
def test_a_bad_restart_count_is_refused_naming_it(monkeypatch, raw):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", raw)
    with pytest.raises(ValueError, match=f"TORCHELASTIC_RESTART_COUNT='{raw}'"):
        restart_count()
