"""A push request not admitted within its deadline (``timeouts.admit_s``) is withdrawn and
asked again after the client's backoff (issue 16; the rule: dips.algo.hold.admission and
next_backoff, as the real leader's request_push and client use them)."""

from __future__ import annotations

import pytest

from dips.algo.hold import Admission
from dips.sim import rounds, simulate
from dips.sim.engine import Simulation
from tests.sim.helpers import small

pytestmark = pytest.mark.timeout(120)


def _queued(admit_s: float):
    """Rounds whose update phase (~1.7 s) outlasts the deadline: requests arriving in it wait."""
    return small(leader={"timeouts": {"admit_s": admit_s}, "grace": {"window_s": 2.0}},
                 followers={"update_s_per_param": 4e-6})


def test_requests_waiting_past_their_deadline_are_withdrawn_and_asked_again(monkeypatch):
    answers, retries = [], []
    real_admission, real_retry = rounds.admission, Simulation._on_admit_retry
    monkeypatch.setattr(rounds, "admission",
                        lambda *a: answers.append(real_admission(*a)) or answers[-1])
    monkeypatch.setattr(Simulation, "_on_admit_retry",
                        lambda self, t, p: retries.append((t, p)) or real_retry(self, t, p))
    sim = Simulation(_queued(0.3)).run()
    withdrawn = sim.counts["withdrawn"]
    assert withdrawn > 10 and sim.counts["tries_max"] >= 3
    # the decision is the leader's own: each withdrawal is one WITHDRAW answer of admission()
    assert sum(a.what is Admission.WITHDRAW for a in answers) == withdrawn
    assert len(retries) == withdrawn
    # each try is a RequestPush: the pushes' first requests plus one per withdrawal
    assert sim.msgs["RequestPush"] == sum(m.push_no for m in sim.members.values()) + withdrawn
    # the backoff: 0.5 s after a push's first withdrawal, 1 s after its second, ...
    by_push: dict[str, list[float]] = {}
    for t, (cid, _, push_id) in retries:
        by_push.setdefault(push_id.split(".")[0], []).append(t)
    gaps = [round(ts[1] - ts[0], 6) for ts in by_push.values() if len(ts) >= 2]
    assert gaps and all(g == pytest.approx(0.3 + 1.0) for g in gaps)  # deadline + 2nd backoff


def test_a_deadline_longer_than_any_wait_changes_nothing_and_the_run_stays_seeded():
    long = simulate(_queued(30.0))
    assert long["pushes"]["admission"] == {"deadline_s": 30.0, "withdrawn": 0,
                                           "pushes_withdrawn": 0, "tries_max": 1}
    short = simulate(_queued(1.0))
    adm = short["pushes"]["admission"]
    assert adm["withdrawn"] >= adm["pushes_withdrawn"] > 0
    assert sum(c["requests_withdrawn"] for c in short["clusters"].values()) == adm["withdrawn"]
    assert simulate(_queued(1.0)) == short  # same seed, same document
