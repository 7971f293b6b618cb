"""``dips report`` on the end of a run (review 33 of issue 15, m3): the pushes withdrawn by
clusters leaving the finished run and the launcher's own shutdown kills are neither faults
nor rejections in any count."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dips.bench.runreport.build import write_report
from dips.bench.runreport.faults import fault_counts, fault_rows, rejections
from dips.bench.runreport.files import load_run
from tests.report.fixtures import T0


def _jsonl(path: Path, records: list[Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def _finished_run(run: Path) -> Path:
    """Round 3 stepped (b rejected by the penalty); the run finished; a and c left with
    their pushes of round 4 withdrawn; the launcher killed cluster-a at its shutdown."""
    (run / "train_start").parent.mkdir(parents=True, exist_ok=True)
    (run / "train_start").write_text(str(T0))
    _jsonl(run / "events.jsonl", [
        {"time": T0 + 20, "event": "stop", "process": "launcher", "reason": "max time"},
        {"time": T0 + 26, "event": "killed", "process": "cluster-a"},
        {"time": T0 + 26.1, "event": "stopped", "process": "cluster-a", "returncode": -9}])
    _jsonl(run / "leader_events.jsonl", [
        {"time": T0 + 19, "event": "run_finished", "reason": "time limit", "version": 3},
        {"time": T0 + 19.5, "event": "cluster_left", "cluster": "a"},
        {"time": T0 + 19.6, "event": "cluster_left", "cluster": "c"}])
    gone = {"reason": "cluster left", "tokens": 100}
    _jsonl(run / "outer_steps.jsonl", [
        {"round": 3, "version": 3, "clusters": ["a", "b"], "accepted": ["a"], "time": T0 + 18,
         "rejected": {"b": {"score": 9.0, "reason": "penalty", "code": "penalty"}},
         "tokens": {"a": 100, "b": 100}},
        {"round": 4, "version": 3, "clusters": [], "accepted": [], "rejected": {},
         "tokens": {}, "withdrawn": {"a": gone, "c": gone}, "time": T0 + 19.7}])
    return run


def test_the_end_of_a_run_is_no_fault_and_no_rejection(tmp_path):
    run = load_run(_finished_run(tmp_path / "run"))
    assert rejections(run) == {"penalty": 1}
    rows = fault_rows(run)
    assert [r.kind for r in rows] == [], rows
    assert fault_counts(rows) == {}
    html = write_report(tmp_path / "run", tmp_path / "out").html.read_text(encoding="utf-8")
    assert "cluster_gone" not in html and "killed" not in html
