"""Fixtures shared by the role tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def fsynced(monkeypatch) -> list[str]:
    """The paths passed to ``os.fsync`` during the test, resolved from their descriptors."""
    seen: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen
