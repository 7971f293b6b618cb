"""A leader that dies between the two durable writes of a decided round (``leader.json`` and
the round's line of ``outer_steps.jsonl``), at the ``decided`` failpoint of
:mod:`dips.roles.leader_records` (review 33 of issue 15, M1): the restarted leader and every
reader of the records agree on which steps the model holds — the records never claim a step
the model does not hold, nor miss one it does; the summary's per-cluster counts add up to the
leader's totals, the metrics replayed from the files equal them, and no version is counted
twice."""

from __future__ import annotations

import contextlib
import json
import threading

import pytest
from prometheus_client import CollectorRegistry

from dips.algo.refusal import Refused
from dips.algo.pushcounts import PER_CLUSTER, leader_counts
from dips.emu.summary import read_jsonl
from dips.node.metrics import LeaderMetrics
from dips.roles import leader_records
from dips.roles.outer_log import end_torn_line, last_decision_round
from tests.roles.test_leader_exactly_once import TPW, Run, wait_for

pytestmark = pytest.mark.timeout(90)


class DeathAt:
    """A stand-in for :func:`dips.roles.failpoints.hit`: the thread that reaches ``point``
    stops there for good (the process "died": it writes nothing more)."""

    def __init__(self, point: str) -> None:
        self.point = point
        self.reached = threading.Event()
        self._never = threading.Event()

    def __call__(self, point: str) -> None:
        if point == self.point:
            self.reached.set()
            self._never.wait()


def _decisions(path) -> list[dict]:
    return [r for r in read_jsonl(path) if "event" not in r and "accepted" in r]


def _check_records_agree(run_dir, leader) -> None:
    """The checks of review 33, M1, on the files and a metrics registry replayed from them."""
    counts = leader.counts
    per = leader_counts(read_jsonl(run_dir / "outer_steps.jsonl"))
    sums = {k: sum(row[k] for row in per.values()) for k in PER_CLUSTER}
    for key in ("updates_pushed", "updates_accepted", "updates_rejected", "tokens_pushed",
                "tokens_accepted"):
        assert sums[key] == counts[key], (key, sums, counts)
    assert counts["tokens_accepted"] == leader.ledger.accepted_windows * TPW
    # Every version the model holds decided once, none it does not hold.
    versions = [r["version"] for r in _decisions(run_dir / "outer_steps.jsonl") if r["accepted"]]
    assert versions == list(range(1, leader.version + 1)), versions
    rounds = [r["round"] for r in _decisions(run_dir / "outer_steps.jsonl")]
    assert rounds == sorted(set(rounds)), rounds  # each round's line once
    # The restarted leader's metrics (replayed from the files) equal the files.
    registry = CollectorRegistry()
    metrics = LeaderMetrics(registry)
    metrics.replay(run_dir)
    metrics.attach(leader)
    value = registry.get_sample_value
    assert (value("dips_pushes_total", {"result": "accepted", "reason": "none"}) or 0.0) == \
        counts["updates_accepted"]
    rejected = sum(value("dips_pushes_total", {"result": "rejected", "reason": r}) or 0.0
                   for r in ("not_delivered", "penalty"))
    assert rejected == counts["updates_rejected"]
    cluster_tokens = sum(value("dips_cluster_tokens_pushed_total", {"cluster": c}) or 0.0
                         for c in per)
    assert cluster_tokens == value("dips_tokens_pushed_total") == counts["tokens_pushed"]
    assert value("dips_outer_steps_total") == counts["outer_steps"] == leader.version


def _die_at_decided(tmp_path, monkeypatch, delivered: bool):
    """Round 1 accepted; round 2's push (``delivered`` or not) kills the leader at the
    ``decided`` failpoint. Returns (the dead run, round 2's grant)."""
    run = Run(tmp_path)
    death = DeathAt("decided")
    try:
        chunks = run.member("a")
        c0 = min(chunks)
        first = run.leader.request_push("a", 0, 1, 5.0, {c0: 2})
        assert run.leader.push_done("a", first.push_id, True, "", 3.0).verdict.version == 1
        wait_for(lambda: run.leader.phase == "idle", "round 1 ended")
        monkeypatch.setattr(leader_records.failpoints, "hit", death)
        grant = run.leader.request_push("a", 1, 1, 5.0, {c0: 5})

        def ask() -> None:  # the cluster's first ask: the leader dies before it answers
            with contextlib.suppress(Refused):
                run.leader.push_done("a", grant.push_id, delivered,
                                     "" if delivered else "link cut", 3.0)

        threading.Thread(target=ask, daemon=True).start()
        assert death.reached.wait(30), "the decided failpoint was not reached"
    finally:
        # The dead leader's threads stay where they are (one holds its lock for good).
        run._stop.set()
        run.leader._stop.set()
    monkeypatch.undo()
    return run, grant


def test_a_leader_dead_between_leader_json_and_the_decision_line(tmp_path, monkeypatch):
    run, grant = _die_at_decided(tmp_path, monkeypatch, delivered=True)
    for f in run.fakes:  # prepared everywhere, committed nowhere
        assert f.prepared == 2 and f.version == 1
    with open(tmp_path / "outer_steps.jsonl", "a") as f:
        f.write('{"round": 2, "version": 2, "accep')  # it died in the middle of the line
    restarted = Run(tmp_path, fakes=run.fakes)  # the followers outlive the leader
    try:
        leader = restarted.leader
        _check_records_agree(tmp_path, leader)
        reply = leader.push_done("a", grant.push_id, True, "", 5.0)
        assert reply.verdict.accepted and reply.verdict.version == 2
        assert leader.version == 2 and all(f.version == 2 for f in run.fakes)
        assert json.loads((tmp_path / "leader.json").read_text())["version"] == 2
    finally:
        restarted.close()


def test_a_round_that_applied_nothing_is_recorded_in_the_same_order(tmp_path, monkeypatch):
    """A round whose push failed (nothing accepted): the leader dies between its two writes;
    the restarted leader counts the rejection, and so does every reader, once."""
    run, grant = _die_at_decided(tmp_path, monkeypatch, delivered=False)
    restarted = Run(tmp_path, fakes=run.fakes)
    try:
        leader = restarted.leader
        _check_records_agree(tmp_path, leader)
        assert leader.version == 1 and leader.counts["updates_rejected"] == 1
        reply = leader.push_done("a", grant.push_id, False, "link cut", 5.0)
        assert not reply.verdict.accepted  # re-served, not decided again
        _check_records_agree(tmp_path, leader)
    finally:
        restarted.close()


def test_the_last_decision_round_is_read_from_the_end(tmp_path):
    path = tmp_path / "outer_steps.jsonl"
    assert last_decision_round(path) is None
    path.write_text("")
    assert last_decision_round(path) is None
    big = {"round": 7, "version": 3, "accepted": ["a"], "pad": "x" * 70_000}  # > one block
    lines = [{"round": 6, "version": 3, "accepted": []}, big,
             {"event": "round_end", "round": 7}, {"event": "rollback", "version": 2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"round": 8, "acc')
    assert last_decision_round(path) == 7
    end_torn_line(path)
    assert path.read_text().endswith('"acc\n')
    end_torn_line(path)  # a whole last line: nothing to do
    assert path.read_text().endswith('"acc\n')
    with open(path, "a") as f:
        f.write(json.dumps({"round": 9, "version": 3, "accepted": [], "error": "x"}) + "\n")
    assert last_decision_round(path) == 9
