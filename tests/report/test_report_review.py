"""``dips report`` on the inputs a fresh review of issue 15 found it wrong on (one test each).

Each input is small and synthetic (the records the roles write, as in tests/report/fixtures.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dips.bench.runreport.build import OutRequired, SeveralRuns, write_report
from dips.bench.runreport.faults import fault_rows
from dips.bench.runreport.files import load_run
from dips.bench.runreport.run_plots import cluster_steps, plot_tokens_per_cluster
from dips.cli import app
from dips.emu.summary import tokens_consumed
from dips.spec import ClusterConfig, RunConfig
from tests.report.fixtures import T0


def _jsonl(path: Path, records: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _step(step: int, tokens: int, t: float, loss: float = 5.0) -> dict[str, Any]:
    return {"step": step, "loss": loss, "tokens": tokens, "compute_s": 0.5, "time": T0 + t}


def _resumed_cluster(run: Path) -> Path:
    """Cluster ``a``: killed at step 4 (1,024 tokens), resumed the state saved at step 2
    (512 tokens) and trained steps 3-5 again, then killed and started fresh (step 1)."""
    (run / "train_start").parent.mkdir(parents=True, exist_ok=True)
    (run / "train_start").write_text(str(T0))
    recs = [{"event": "join", "cluster": "a", "version": 0, "time": T0}]
    recs += [_step(s, 256 * s, s) for s in (1, 2, 3, 4)]
    recs += [{"event": "join", "cluster": "a", "version": 1, "time": T0 + 10},
             {"event": "resume", "version": 1, "saved_step": 2, "steps": 2, "tokens": 512,
              "time": T0 + 10}]
    recs += [_step(s, 256 * s, 8 + s) for s in (3, 4, 5)]
    recs += [{"event": "join", "cluster": "a", "version": 2, "time": T0 + 20},
             _step(1, 256, 21)]
    return _jsonl(run / "clusters" / "a" / "train.jsonl", recs)


def test_a_resumed_clusters_tokens_count_each_step_once_as_the_summary_does(tmp_path):
    """Finding 1: the report counted the saved 512 tokens again after a ``resume``
    (1,024 + 1,280 + 256): each step record counts once, 1,024 + 768 + 256."""
    run = tmp_path / "run"
    _resumed_cluster(run)
    cfg = RunConfig(clusters=[ClusterConfig(id="a")])
    expected = 1024 + 768 + 256
    assert tokens_consumed(run, cfg) == {"a": expected}
    files = load_run(run)
    steps = cluster_steps(files, files.clusters["a"])
    assert steps.tokens == [256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert steps.tokens[-1] == expected
    assert steps.lifetimes == [0, 4, 7]  # three processes: the line breaks twice
    plot = plot_tokens_per_cluster(files)
    bars = [p.get_height() for p in plot.figure.axes[0].patches]
    assert bars == [expected]


def _diverging_run(run: Path) -> Path:
    """Clusters ``a`` (loss 8 -> 5) and ``b`` (loss 8 -> 11,719: diverged), 40 steps each."""
    (run / "train_start").parent.mkdir(parents=True, exist_ok=True)
    (run / "train_start").write_text(str(T0))
    for cid, end in (("a", 5.0), ("b", 11_719.0)):
        recs = [{"event": "join", "cluster": cid, "version": 0, "time": T0}]
        recs += [_step(s, 100 * s, s, 8.0 + (end - 8.0) * s / 40) for s in range(1, 41)]
        _jsonl(run / "clusters" / cid / "train.jsonl", recs)
    return run


def test_a_diverging_cluster_does_not_set_the_run_reports_y_axis(tmp_path):
    """Finding 3: cluster b's loss (11,719) set the y-axis and flattened a's curve; the rule
    of the compare report (dips.bench.runreport.figs.draw_losses) applies: the axis follows
    the curves that converge, b is labelled and marked with its final loss."""
    rep = write_report(_diverging_run(tmp_path / "run"), tmp_path / "out")
    for name in ("loss_vs_time.png", "loss_vs_tokens.png"):
        plot = next(p for p in rep.plots if p.name == name)
        ax = plot.figure.axes[0]
        lo, hi = ax.get_ylim()
        assert 4.0 < lo < 5.0 and 8.0 < hi < 9.0, (name, lo, hi)
        labels = ax.get_legend_handles_labels()[1]
        assert any(lab.startswith("b") and lab.endswith("(diverged)") for lab in labels)
        assert not any(lab.startswith("a") and "diverged" in lab for lab in labels)
        (note,) = [t for t in ax.texts if "diverged" in t.get_text()]
        assert "final loss" in note.get_text() and note.xy[1] <= hi
        assert "diverged: b" in (plot.note or "")


def _faulty_run(run: Path) -> Path:
    """A launch run: cluster a killed at 5 s (exit -9), restarted by the supervisor, joined
    again; follower 1 down at 8 s (data plane) and up at 9 s; the leader restarted at 12 s;
    two pushes rejected while follower 1 was down, one by the penalty."""
    (run / "train_start").parent.mkdir(parents=True, exist_ok=True)
    (run / "train_start").write_text(str(T0))
    _jsonl(run / "events.jsonl", [
        {"time": T0 - 2, "event": "start", "process": "cluster-a", "pid": 1},
        {"time": T0 + 5, "event": "fault", "process": "cluster-a", "action": "kill", "pid": 1},
        {"time": T0 + 5.2, "event": "exited", "process": "cluster-a", "returncode": -9},
        {"time": T0 + 5.3, "event": "restart", "process": "cluster-a", "pid": 2},
        {"time": T0 + 20, "event": "stop", "process": "launcher", "reason": "max time"},
        {"time": T0 + 21, "event": "exited", "process": "follower-0", "returncode": 0}])
    _jsonl(run / "leader_events.jsonl", [
        {"time": T0, "event": "cluster_joined", "cluster": "a", "rejoin": False, "version": 0},
        {"time": T0 + 7, "event": "cluster_joined", "cluster": "a", "rejoin": True, "version": 2},
        {"time": T0 + 8, "event": "follower_down", "follower": 1, "cause": "data plane",
         "error": "UNAVAILABLE: failed to connect to all addresses"},
        {"time": T0 + 9, "event": "follower_up", "follower": 1, "incarnation": 1,
         "restarted": False},
        {"time": T0 + 12, "event": "leader_resumed", "version": 3}])
    down = {"score": None, "reason": "follower 1 down", "code": "followers_not_ready"}
    _jsonl(run / "outer_steps.jsonl", [
        {"round": 4, "version": 2, "clusters": ["a", "b"], "accepted": [], "time": T0 + 8.5,
         "rejected": {"a": down, "b": down}, "tokens": {"a": 100, "b": 100}},
        {"round": 5, "version": 3, "clusters": ["a", "b"], "accepted": ["a"], "time": T0 + 10,
         "rejected": {"b": {"score": 9.0, "reason": "penalty", "code": "penalty"}},
         "tokens": {"a": 100, "b": 100}}])
    return run


def test_the_report_shows_the_runs_faults_and_rejections_by_their_typed_reason(tmp_path):
    """Finding 4: the page showed no faults and grouped rejections by their raw text."""
    rep = write_report(_faulty_run(tmp_path / "run"), tmp_path / "out")
    html = rep.html.read_text(encoding="utf-8")
    assert "rejections by reason</th><td>followers_not_ready: 2, penalty: 1<" in html
    assert "follower 1 down" not in html  # the text is not a group
    rows = [(round(r.time_s, 3), r.kind, r.member, r.source)
            for r in fault_rows(load_run(tmp_path / "run"))]
    assert rows == [(5.0, "kill", "cluster-a", "launcher"),
                    (5.2, "exited", "cluster-a", "launcher"),
                    (5.3, "restart", "cluster-a", "launcher"),
                    (7.0, "cluster_rejoined", "cluster-a", "leader"),
                    (8.0, "follower_down", "follower-1", "leader"),
                    (9.0, "follower_up", "follower-1", "leader"),
                    (12.0, "leader_restarted", "leader", "leader")]
    assert "<h2>Faults and recoveries</h2>" in html
    assert "follower_down (data_plane): 1" in html and "leader_restarted: 1" in html
    assert html.count("<td>follower-1</td>") == 2


def test_a_run_without_faults_says_so(tmp_path):
    run = _resumed_cluster(tmp_path / "run").parent.parent.parent
    html = write_report(run, tmp_path / "out").html.read_text(encoding="utf-8")
    assert "faults and recoveries</th><td>none recorded<" in html
    assert "no fault recorded" in html


def test_duplicate_copies_are_read_once_and_said_so(tmp_path):
    """Finding 5: a run directory holding host copies of the same files was merged silently
    (each of a's steps counted twice). Duplicates are read once and named."""
    run = tmp_path / "run"
    train = _resumed_cluster(run)
    copy = run / "hosts" / "site-a" / "state" / "train.jsonl"
    copy.parent.mkdir(parents=True)
    copy.write_bytes(train.read_bytes())
    early = run / "hosts" / "site-a" / "older" / "train.jsonl"  # a copy taken earlier
    early.parent.mkdir(parents=True)
    early.write_text("".join(train.read_text().splitlines(keepends=True)[:3]))
    (run / "hosts" / "train_start").write_text((run / "train_start").read_text())
    files = load_run(run)
    assert cluster_steps(files, files.clusters["a"]).tokens[-1] == 1024 + 768 + 256
    assert sorted(files.notes) == sorted([
        f"{copy} is the same as {train}: read once",
        f"{early} is an earlier copy of {train}: read once",
        f"{run / 'hosts' / 'train_start'} is the same as {run / 'train_start'}: read once"])
    res = CliRunner().invoke(app, ["report", str(run)])
    assert res.exit_code == 0, res.output
    assert f"note: {copy} is the same as {train}: read once" in res.output
    assert "read once" in (run / "report" / "report.html").read_text(encoding="utf-8")


def test_several_runs_in_one_directory_are_refused_naming_them(tmp_path):
    """Finding 5: two runs under one directory were merged into one report."""
    one, two = _resumed_cluster(tmp_path / "runs" / "one"), _faulty_run(tmp_path / "runs" / "two")
    assert one and two
    (tmp_path / "runs" / "two" / "train_start").write_text(str(T0 + 100))
    with pytest.raises(SeveralRuns) as err:
        write_report(tmp_path / "runs", tmp_path / "out")
    assert str(tmp_path / "runs" / "one" / "train_start") in str(err.value)
    assert str(tmp_path / "runs" / "two" / "train_start") in str(err.value)
    res = CliRunner().invoke(app, ["report", str(tmp_path / "runs"), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "several runs" in res.output
    assert not (tmp_path / "o").exists()


def test_the_output_goes_to_a_folder_of_its_own_and_only_where_it_is_asked(tmp_path):
    """Finding 5: ``dips report /tmp`` wrote report.html and the PNGs into /tmp. By default
    the report goes to RUN_DIR/report/, and only when RUN_DIR is a run's own directory."""
    run = _faulty_run(tmp_path / "top" / "run")
    res = CliRunner().invoke(app, ["report", str(run)])
    assert res.exit_code == 0, res.output
    assert (run / "report" / "report.html").is_file() and not (run / "report.html").exists()
    before = sorted(p.name for p in (tmp_path / "top").iterdir())
    res = CliRunner().invoke(app, ["report", str(tmp_path / "top")])  # runs below, none here
    assert res.exit_code == 2 and "give --out DIR" in res.output
    assert str(run) in res.output
    assert sorted(p.name for p in (tmp_path / "top").iterdir()) == before  # nothing written
    with pytest.raises(OutRequired, match="its run files lie below"):
        write_report(tmp_path / "top")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(OutRequired, match="holds no run's files"):
        write_report(empty)


def test_follower_utilisation_from_the_busy_time_the_followers_record(tmp_path):
    """Finding 10: the report had no follower utilisation. A follower's applied records carry
    its busy seconds by phase (update, push, pull) over the span since the previous one."""
    run = _resumed_cluster(tmp_path / "run").parent.parent.parent
    for f, push in ((0, 0.5), (1, 1.5)):
        _jsonl(run / "followers" / str(f) / "applied.jsonl", [
            {"version": v, "round": v, "accepted": ["a"], "follower": f, "time": T0 + 2.0 * v,
             "busy_s": {"update": 0.2, "push": push, "pull": 0.1}, "span_s": 2.0}
            for v in range(1, 11)])
    plot = next(p for p in write_report(run, tmp_path / "out").plots if p.name == "followers.png")
    assert plot.note is None and len(plot.figure.axes) == 2
    assert plot.series == 6  # three phases on each follower's axes
    for ax, push in zip(plot.figure.axes, (0.5, 1.5)):
        assert ax.get_ylim() == (0, 1.6 * 90.0)  # one scale: the busiest, 90%, and room
        assert "% of wall time" in ax.get_ylabel()
        heights = [round(b.get_height(), 6) for b in ax.patches]
        assert heights == [10.0] * 10 + [50.0 * push] * 10 + [5.0] * 10  # update, push, pull
        busy = 10.0 + 50.0 * push + 5.0
        assert ax.get_title() == f"follower {ax.get_ylabel().split()[1]}: busy {busy:.1f}% " \
                                 "of the 20.0 s its records cover (to 20.0 s)"
    assert "wall time since the training start (s)" in plot.figure.axes[-1].get_xlabel()


def test_members_control_characters_never_reach_the_html():
    """Review 26, M8: ESC and BEL from the run's files (members' text) made report.html
    invalid HTML; they are replaced, markup and tags stay escaped text."""
    from dips.bench.runreport.page import Page, Table, render

    hostile = "\x1b[31mRED\x1b[0m\x1b]0;pwned\x07<script>alert(1)</script>[/x]"
    html = render(Page(title="run " + hostile, facts=[("cluster", hostile)],
                       tables=[Table(hostile, ["reason"], [[hostile]], note=hostile)],
                       notes=[hostile]), {})
    assert "\x1b" not in html and "\x07" not in html
    assert "<script>" not in html and "&lt;script&gt;" in html and "[/x]" in html
