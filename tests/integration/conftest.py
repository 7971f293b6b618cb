"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest

from tests.integration import shared_run


@pytest.fixture(scope="package")
def quiet_run(tmp_path_factory) -> shared_run.SharedRun:
    """The one fault-free `dips launch` (a slow link) that test_exactly_once.py and
    test_interrupt.py (SIGINT, a second leader) each check a property of: see shared_run.py.
    Run once, by whichever of them comes first."""
    return shared_run.run(tmp_path_factory.mktemp("quiet-run"))
