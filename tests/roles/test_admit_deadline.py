"""The leader withdraws a push request not admitted by its deadline (``timeouts.admit_s``):
the wait's decision is dips.algo.hold.admission, which dips simulate calls too (issue 16).
In process, a leader whose threads are not started, its clock moved by hand."""

from __future__ import annotations

import pytest

from dips.algo.refusal import Refusal, Refused
from dips.algo.round import Tick, slot_of
from tests.roles.test_hostile_join import RUN, Clock, leader_on

pytestmark = pytest.mark.timeout(60)


def test_a_request_not_admitted_by_its_deadline_is_withdrawn(tmp_path):
    """The wait's decision (dips.algo.hold.admission, which dips simulate calls too): b asks
    while a's round pushes; at its deadline the leader withdraws it (NOT_ADMITTED) and the
    next round does not hold it."""
    clock = Clock()
    leader = leader_on(clock, tmp_path)
    leader.needs_reconcile = False  # (its followers are names only: nothing to reconcile)
    for c in ("a", "b"):
        leader.join_cluster(c, [["l0", "l1"]], RUN)
    leader.request_push("a", 0, 64, 5.0)  # opens the window: admitted at once
    with leader._cond:
        leader._apply(Tick(clock.t + 60.0))  # the window closed: a's round pushes
    with pytest.raises(Refused) as info:
        leader.request_push("b", 0, 64, 0.0)  # its deadline has passed: it waits no longer
    assert info.value.code is Refusal.NOT_ADMITTED and "not admitted in 0.0 s" in str(info.value)
    assert slot_of(leader._state, "b") is None and leader._state.queue == ()
    with pytest.raises(Refused):
        leader.request_push("b", 0, 64, 5.0, cancelled=lambda: True)  # its caller gave up
    assert leader._state.queue == ()
