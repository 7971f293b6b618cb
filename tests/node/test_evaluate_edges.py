"""Two edges of the held-out series (issue 15).

The run's end outside the leader: with ``final`` set (SIGUSR1, sent by ``dips launch`` when
its ``--max-time`` ends the run) the evaluator takes the current version as the final one
although it is not due.

A rollback (§12): when the leader reconciles its followers to an older version t, the
versions above t are made again with other content, so the leader takes their reports again
(it refused them as "repeated" or "older" until the version climbed past the last one
reported), never a repeat of a version whose content did not change, also after its
restart; the evaluator goes on from the multiple of ``every`` at or below t. The rollback is
the leader's own (a follower that lost its committed steps, a failed commit,
reconciliation); the pulls are stand-ins; waits are for events."""

from __future__ import annotations

import json

import pytest

from dips.algo.evaluation import EvalReport, Lineage, Schedule
from dips.algo.refusal import Refused
from dips.roles.leader import FollowerEntry, Leader
from tests.node.test_evaluate_loop import Harness, Pull, step, versions
from tests.roles.test_hostile_leader import wait_for

pytestmark = pytest.mark.timeout(120)


def test_the_lineage_forgets_records_above_a_rollback_and_keeps_the_rest():
    lin = Lineage()
    assert lin.last() is None
    for v in (0, 2, 4, 6, 8):
        lin.add(v, float(v))
    lin.rolled_back(6)
    assert (lin.versions, lin.last()) == ([0, 2, 4, 6], 6)  # 6 itself: same content
    lin.rolled_back(5)
    assert lin.last() == 4  # 5 was never recorded: a report of it is taken
    lin.add(5, 9.0)
    assert lin.versions == [0, 2, 4, 5] and lin.time == 9.0
    short = Lineage(keep=2)
    for v in (1, 2, 3, 4):
        short.add(v)
    assert (short.versions, short.below) == ([3, 4], 2)
    short.rolled_back(3)
    assert short.last() == 3
    short.rolled_back(1)  # below every version kept, above a dropped one: 1 counts as recorded
    assert (short.versions, short.last()) == ([], 1)
    assert Lineage.from_dict(lin.to_dict()) == Lineage(lin.versions, lin.below, lin.time)
    for bad, field in (({"versions": [3, 1]}, "versions"), ({"versions": [], "below": "x"},
                                                           "below"), ([1], "not an object")):
        with pytest.raises(ValueError, match=field):
            Lineage.from_dict(bad)


def test_the_evaluator_goes_on_from_the_multiple_at_or_below_the_rollback():
    s = Schedule(every=4)
    s.done(8)
    assert not s.rolled_back(8) and not s.rolled_back(9)
    assert s.rolled_back(6) and s.last == 4
    assert s.target(6, False, True, 0.0) is None and s.target(8, False, True, 0.0) == 8


def roll_back(site, to: int) -> None:
    """A follower lost its committed steps above ``to`` (its checkpoints end there) and its
    commit failed: it registers again and the leader reconciles every follower to ``to``."""
    leader = site.leader
    fake = leader.followers[0].control
    lost_before = leader.counts["outer_steps_lost"]
    fake.version = to
    leader.commit_failed([0])
    leader.register_follower(FollowerEntry(0, "tcp://127.0.0.1:1", "", ["l0", "l1"], [4, 4]))
    def reconciled() -> bool:  # the last act of reconciling: leader.json written
        doc = json.loads((site.leader._run_dir / "leader.json").read_text())
        return (doc["version"] == to and doc["counts"]["outer_steps_lost"] > lost_before
                and leader.ready)

    wait_for(reconciled, f"the leader reconciled to version {to}")


def test_reports_of_versions_made_again_are_taken_across_a_restart(tmp_path):
    h = Harness(tmp_path)
    try:
        ev = h.evaluator(Pull(6.0, 5.9, 5.8, 5.7, 5.5, 5.4), every=1)
        assert ev.step(now=0.0) == 0.0
        for _ in range(3):
            step(h.site)
            assert ev.step(now=1.0) == 0.0
        assert versions(h.site.leader) == 3 and ev.schedule.last == 3
        roll_back(h.site, 1)  # versions 2 and 3 are gone
        leader = h.site.leader
        with pytest.raises(Refused, match="repeated"):  # version 1 did not change
            leader.report_eval(EvalReport(1, 5.0, 10))
        assert ev.step(now=2.0) == 0.5  # version 1 < 3: goes on from 1 (nothing due yet)
        assert ev.schedule.last == 1
        step(h.site)  # version 2 again, with other content: due, taken
        assert ev.step(now=3.0) == 0.0 and versions(leader) == 2
        lines = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
        assert [r["version"] for r in lines] == [0, 1, 2, 3, 2]
        assert lines[-1]["eval_loss"] == 5.5
        saved = json.loads((tmp_path / "leader.json").read_text())["eval_lineage"]
        assert saved["versions"] == [0, 1, 2]

    finally:
        h.close()
    # A restarted leader (built from its state directory, not started: its stand-in follower
    # would reconcile it again) knows which records still count.
    again = Leader(leader.cfg, connect=lambda entry: None, run_dir=tmp_path)
    assert again.version == 2 and again.eval_lineage_state()["versions"] == [0, 1, 2]
    with pytest.raises(Refused, match="repeated"):
        again.report_eval(EvalReport(2, 5.0, 10))
    with pytest.raises(Refused, match="older than the last report"):
        again.report_eval(EvalReport(1, 5.0, 10))


def test_a_final_request_evaluates_the_current_version_once(tmp_path):
    h = Harness(tmp_path)
    try:
        ev = h.evaluator(Pull(6.0, 5.5), every=4)
        assert ev.step(now=0.0) == 0.0  # version 0
        step(h.site), step(h.site)
        assert ev.step(now=1.0) == 0.5 and versions(h.site.leader) == 0  # 2: not due
        ev.final.set()  # the launcher's clock ended the run; the leader goes on as it was
        assert ev.step(now=2.0) == 0.0 and versions(h.site.leader) == 2
        assert ev.step(now=3.0) == 0.5 and ev.counts["reported"] == 2  # once
    finally:
        h.close()
