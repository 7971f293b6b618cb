"""``dips report`` after review 28 of issue 15: a member's records from several files merged by
time, not path (#1); a fault-free timeline zoom whose title says what it shows (#4); the
initial held-out loss drawn without an evaluator (#5). Inputs are synthetic, shaped like the
review's run B (tests/report/fixtures.py)."""

from __future__ import annotations

import pytest

from dips.bench.runreport.build import write_report
from dips.bench.runreport.files import by_time, load_run
from dips.bench.runreport.run_plots import cluster_steps
from tests.report.fixtures import T0, _jsonl

pytestmark = pytest.mark.timeout(120)


def _lifetime(first: int, n: int, t0: float, loss0: float, dloss: float) -> list[dict]:
    return [{"step": s, "loss": loss0 - dloss * (s - first), "tokens": 256 * (s - first + 1),
             "compute_s": 0.04, "time": t0 + 0.1 * (s - first + 1)} for s in range(first, first + n)]


def make_restarted_on_another_host(root):
    """Cluster c's first process (steps 1-40, loss 6.2 -> 4.6) on host ``c-site-z``; after a
    kill it resumed from its step-32 checkpoint on host ``c-site-a`` (steps 33-60, loss 4.5 ->
    4.3): the second lifetime's path sorts first (review 28 #1)."""
    leader = root / "hosts" / "leader" / "state"
    leader.mkdir(parents=True)
    (leader / "train_start").write_text(str(T0))
    _jsonl(leader / "leader_events.jsonl", [
        {"time": T0, "event": "cluster_joined", "cluster": "c", "rejoin": False, "version": 0}])
    _jsonl(root / "hosts" / "c-site-z" / "state" / "train.jsonl",
           [{"event": "join", "cluster": "c", "version": 0, "time": T0}]
           + _lifetime(1, 40, T0, 6.2, 0.04))
    _jsonl(root / "hosts" / "c-site-a" / "state" / "train.jsonl",
           [{"event": "join", "cluster": "c", "version": 9, "time": T0 + 20.0},
            {"event": "resume", "version": 7, "saved_step": 32.0, "steps": 32, "tokens": 8192,
             "time": T0 + 20.0}]
           + _lifetime(33, 28, T0 + 20.0, 4.5, 0.007))
    return root


def test_a_clusters_lifetimes_from_two_hosts_are_merged_by_time_not_path(tmp_path):
    """Path order put c's second lifetime first: drawn at 0-7k tokens, its first after it,
    and c labelled "(diverged)" (its last smoothed loss above its first)."""
    run = load_run(make_restarted_on_another_host(tmp_path / "run"))
    recs = run.clusters["c"]
    times = [r["time"] for r in recs]
    assert times == sorted(times)
    assert recs[0]["version"] == 0 and [r.get("step") for r in recs if "step" in r][:2] == [1, 2]
    steps = cluster_steps(run, recs)
    assert steps.lifetimes == [0, 40]
    assert steps.loss[0] == pytest.approx(6.2) and steps.loss[-1] < 4.4
    assert steps.tokens == sorted(steps.tokens)
    assert any("merged by time" in n for n in run.notes)
    rep = write_report(tmp_path / "run", tmp_path / "out")
    for name in ("loss_vs_time.png", "loss_vs_tokens.png"):
        plot = next(p for p in rep.plots if p.name == name)
        labels = [line.get_label() for ax in plot.figure.axes for line in ax.lines]
        assert not any("diverged" in lb for lb in labels), (name, labels)
        assert "diverged" not in (plot.note or ""), name


def test_by_time_keeps_untimed_records_with_their_predecessor():
    a = [{"x": 1, "time": 5.0}, {"x": 2}, {"x": 3, "time": 7.0}]
    b = [{"y": 1}, {"y": 2, "time": 6.0}]
    assert [r["x"] if "x" in r else 10 * r["y"] for r in by_time([a, b])] == [10, 1, 2, 20, 3]
    assert by_time([a]) == a
