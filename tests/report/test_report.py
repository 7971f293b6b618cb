"""``dips report``: the page is self-contained valid HTML, every plot is there with its series.

Inputs are synthetic (tests/report/fixtures.py): a run whose roles' files lie in per-host
folders, a comparison with a diverged method, a weak-scaling comparison, and runs with pieces
missing.  Series counts follow from the inputs (see each test).
"""

from __future__ import annotations

import base64
import json
from html.parser import HTMLParser
from pathlib import Path

from typer.testing import CliRunner

from dips.bench.runreport.build import write_report
from dips.bench.runreport.files import load_run, read_jsonl
from dips.bench.runreport.round_plots import staleness_of
from dips.bench.runreport.timeline import sync_bars
from dips.bench.runreport.run_plots import cluster_steps
from dips.cli import app
from tests.report.fixtures import (
    T0,
    make_compare,
    make_multihost_run,
    make_weak_scaling,
)

VOID = {"meta", "img", "br", "hr", "link", "input"}


class Checker(HTMLParser):
    """Collects tag-balance errors, every src/href, and the images' sources."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.urls: list[str] = []
        self.images: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for k, v in attrs:
            if k in ("src", "href") and v is not None:
                self.urls.append(v)
                if tag == "img":
                    self.images.append(v)
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def check_page(path: Path) -> Checker:
    """Parse ``path``; assert balanced tags, no external URL; return the checker."""
    text = path.read_text(encoding="utf-8")
    parser = Checker()
    parser.feed(text)
    parser.close()
    assert parser.errors == [] and parser.stack == [], (parser.errors, parser.stack)
    assert text.startswith("<!DOCTYPE html>")
    assert not [u for u in parser.urls if not u.startswith("data:image/png;base64,")]
    assert "http://" not in text and "https://" not in text
    return parser


def series(rep, name: str) -> int:
    return next(p.series for p in rep.plots if p.name == name)


def test_multihost_run_report(tmp_path):
    run = make_multihost_run(tmp_path / "run")
    rep = write_report(run, tmp_path / "out")
    assert rep.mode == "run"
    page = check_page(rep.html)
    # every plot has data here: seven PNGs, each embedded once, byte for byte
    assert [p.name for p in rep.pngs] == ["loss_vs_time.png", "loss_vs_tokens.png", "timeline.png",
                                          "staleness.png", "scores.png", "tokens_per_cluster.png",
                                          "followers.png"]
    assert len(page.images) == 7
    for uri, png in zip(page.images, rep.pngs):
        assert base64.b64decode(uri.split(",", 1)[1]) == png.read_bytes()
        assert png.read_bytes().startswith(b"\x89PNG")
    # 2 clusters + the held-out series (initial, the eval event, final) + the stop
    assert series(rep, "loss_vs_time.png") == 4
    assert series(rep, "loss_vs_tokens.png") == 3
    # leader: window, push phase, update; clusters: inner steps, push, wait, pull; the stop
    assert series(rep, "timeline.png") == 8
    assert series(rep, "staleness.png") == 2
    # left: site-a, site-b, rejected, threshold; right: accepted, rejected, threshold (median)
    assert series(rep, "scores.png") == 7
    assert series(rep, "tokens_per_cluster.png") == 2
    assert series(rep, "followers.png") == 3  # ps0, ps1, the stop
    # the two bad lines, by file and line number; the rounds around them still read
    text = rep.html.read_text(encoding="utf-8")
    assert len(rep.problems) == 2
    assert "outer_steps.jsonl:3: not JSON" in rep.problems[0]
    assert "outer_steps.jsonl:5: a JSON list" in rep.problems[1]
    assert "outer_steps.jsonl:3" in text and "max time" in text
    assert "carry no utilisation" in text


def test_files_found_by_name_and_owner_folder(tmp_path):
    run = load_run(make_multihost_run(tmp_path / "run"))
    assert sorted(run.clusters) == ["site-a", "site-b"]  # "cluster-site-b" folder included
    assert sorted(run.followers) == ["ps0", "ps1"]
    assert [r["round"] for r in run.outer_steps] == [1, 2, 3] and len(run.round_ends) == 1
    assert run.origin() == T0 and [e["eval_loss"] for e in run.evals] == [7.5]
    a = cluster_steps(run, run.clusters["site-a"])
    assert a.tokens == [100, 200, 300, 400, 500, 600, 700, 800]  # counts on across the restart
    bars = sync_bars(run, run.clusters["site-a"])
    assert bars["inner steps"][0] == (0.0, 3.0 - 0.35 - 0.0)  # from the join to the push
    assert bars["inner steps"][-1] == (6.5, 2.0)  # the restarted process, no sync yet
    assert [round(s, 6) for s, _ in bars["pull"]] == [2.95, 5.95]
    assert staleness_of(run.outer_steps) == {"site-a": [0, 0], "site-b": [1, 1]}


def test_compare_report_marks_the_diverged_method(tmp_path):
    rep = write_report(make_compare(tmp_path / "cmp"), tmp_path / "out")
    assert rep.mode == "compare"
    page = check_page(rep.html)
    assert [p.name for p in rep.pngs] == ["loss_vs_tokens.png", "loss_vs_time.png",
                                          "di-ps_staleness.png", "di-ps_scores.png"]
    assert len(page.images) == 4
    assert series(rep, "loss_vs_tokens.png") == 3 and series(rep, "loss_vs_time.png") == 3
    fig = next(p.figure for p in rep.plots if p.name == "loss_vs_tokens.png")
    ax = fig.axes[0]
    assert ax.get_ylim()[1] < 8.0  # the converging methods set the axis, not 11,719
    assert any("diverged" in t.get_text() for t in ax.texts)
    assert "di-ps-no-clip (diverged)" in ax.get_legend_handles_labels()[1]
    assert series(rep, "di-ps_staleness.png") == 2
    # left: c0, c1, threshold; right: accepted, threshold (median)
    assert series(rep, "di-ps_scores.png") == 5
    assert "diverged: di-ps-no-clip" in rep.html.read_text(encoding="utf-8")


def test_weak_scaling_and_a_folder_of_comparisons(tmp_path):
    make_weak_scaling(tmp_path / "all" / "ws")
    make_compare(tmp_path / "all" / "eta100")
    rep = write_report(tmp_path / "all", tmp_path / "out")
    page = check_page(rep.html)
    names = [p.name for p in rep.pngs]
    assert names == ["eta100_loss_vs_tokens.png", "eta100_loss_vs_time.png",
                     "eta100_di-ps_staleness.png", "eta100_di-ps_scores.png",
                     "ws_loss_vs_tokens.png", "ws_loss_vs_time.png"]
    assert len(page.images) == 6
    assert series(rep, "ws_loss_vs_tokens.png") == 4  # 2 methods × 2 cluster counts
    fig = next(p.figure for p in rep.plots if p.name == "ws_loss_vs_tokens.png")
    assert [ax.get_title() for ax in fig.axes if ax.get_visible()] == ["1 cluster", "2 clusters"]


def test_missing_pieces_become_notes(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    rep = write_report(empty, tmp_path / "out")
    page = check_page(rep.html)
    assert rep.pngs == [] and page.images == [] and rep.problems == []
    text = rep.html.read_text(encoding="utf-8")
    assert "no summary.json" in text and "no cluster train.jsonl found" in text
    assert all(p.figure is None and p.note for p in rep.plots)

    only = make_multihost_run(tmp_path / "partial")  # a copy of one cluster's host only
    for host in ("host-leader", "host-ps0", "host-ps1", "host-b"):
        for f in sorted((only / host).rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
        (only / host).rmdir()
    rep = write_report(only, tmp_path / "out2")
    check_page(rep.html)
    assert series(rep, "loss_vs_time.png") == 1  # site-a's training loss, no held-out point
    assert series(rep, "timeline.png") == 4  # no leader row
    missing = {p.name for p in rep.plots if p.figure is None}
    assert missing == {"staleness.png", "scores.png", "followers.png"}


def test_follower_utilisation_when_recorded(tmp_path):
    root = tmp_path / "run"
    (root / "followers" / "0").mkdir(parents=True)
    (root / "followers" / "0" / "applied.jsonl").write_text("".join(
        json.dumps({"version": v, "time": T0 + v, "idle_fraction": 0.25}) + "\n" for v in (1, 2)))
    rep = write_report(root, tmp_path / "out")
    plot = next(p for p in rep.plots if p.name == "followers.png")
    assert plot.series == 1 and plot.note is None
    assert plot.figure.axes[0].get_ylabel() == "utilisation (% busy)"
    assert list(plot.figure.axes[0].lines[0].get_ydata()) == [75.0, 75.0]


def test_bad_lines_named_by_file_and_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n\n"text"\n{"b": \n{"c": 3}\n')
    problems: list[str] = []
    assert read_jsonl(path, problems) == [{"a": 1}, {"c": 3}]
    assert [p.split(": ", 1)[0] for p in problems] == [f"{path}:3", f"{path}:4"]


def test_a_decision_line_with_fields_of_another_type_is_skipped_not_fatal(tmp_path):
    """Review 15: well-formed objects whose fields have other types (schema drift, a hand
    edit) crashed the whole report with a traceback; now each is skipped and named."""
    run = make_multihost_run(tmp_path / "run")
    steps = next(run.rglob("outer_steps.jsonl"))
    n = len(steps.read_text().splitlines())
    with open(steps, "a") as f:
        f.write('{"round": null, "version": "v", "rejected": [1]}\n')
        f.write('{"round": 3, "version": 3, "accepted": 5}\n')
    res = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert f"outer_steps.jsonl:{n + 1}: field 'rejected' is a list, not a dict" in res.output
    assert f"outer_steps.jsonl:{n + 2}: field 'accepted' is a int, not a list" in res.output
    check_page(tmp_path / "out" / "report.html")


def test_cli_writes_the_report(tmp_path):
    run = make_multihost_run(tmp_path / "run")
    res = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "report.html (run: 7 plots)" in res.output
    assert "outer_steps.jsonl:3" in res.output
    assert (tmp_path / "out" / "timeline.png").is_file()
    res = CliRunner().invoke(app, ["report", str(tmp_path / "nowhere")])
    assert res.exit_code == 2
