"""``dips report RUN_DIR``: read a run (or a comparison), draw its plots, write the page.

Two kinds of input, told apart by their files:

* a **comparison** (``dips bench compare --out DIR``): a ``compare.json`` in the directory, or
  in folders below it (``runs/compare`` holds one per scenario) — loss curves per method, and
  the staleness and scores of its ``di-ps`` method;
* a **run** (``dips launch``, or the state directories of a hand-deployed run copied from
  several hosts into subfolders): everything of :mod:`dips.bench.runreport.files`.

:func:`write_report` writes ``report.html`` and the PNGs into the output directory and returns
what it drew, so callers (and tests) can inspect the figures and their series.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dips.algo.pushcounts import push_counts
from dips.bench.runreport.compare_plots import curves_of, plot_compare_losses
from dips.bench.runreport.faults import FaultRow, fault_counts, fault_rows, rejections
from dips.bench.runreport.figs import Plot
from dips.bench.runreport.files import (
    RunFiles,
    SeveralRuns,
    find,
    load_run,
    num,
    read_json,
    read_jsonl,
)
from dips.bench.runreport.followers import plot_followers
from dips.bench.runreport.page import Page, Table, render
from dips.bench.runreport.round_plots import plot_scores, plot_staleness
from dips.bench.runreport.run_plots import (
    plot_loss_vs_time,
    plot_loss_vs_tokens,
    plot_tokens_per_cluster,
)
from dips.bench.runreport.timeline import plot_timeline

__all__ = ["OutRequired", "Report", "SeveralRuns", "default_out", "write_report"]

_FAULT_ROWS = 500  # rows of the faults table (the counts cover all of them)

_SUMMARY_FACTS = (("method", "method"), ("clusters", "clusters"), ("followers", "followers"),
                  ("H", "inner steps per push (H)"), ("outer_steps", "outer steps"),
                  ("updates_pushed", "updates pushed"), ("updates_accepted", "updates accepted"),
                  ("updates_rejected", "updates rejected"), ("tokens_consumed", "tokens trained on"),
                  ("tokens_accepted", "tokens accepted"),
                  ("eval_loss_initial", "held-out loss, initial (nats/token)"),
                  ("eval_loss_final", "held-out loss, final (nats/token)"),
                  ("train_time_s", "training time (s)"),
                  ("shutdown_s", "shutdown after the stop (s)"),
                  ("final_eval_s", "final evaluation and export (s)"),
                  ("wall_time_s", "wall time (s)"),
                  ("tokens_per_s", "tokens/s"))


@dataclass
class Report:
    """What :func:`write_report` wrote.

    Attributes:
        html: the page's path.
        mode: ``run`` or ``compare``.
        plots: every plot, drawn or not (a plot without a figure has a note).
        pngs: the PNG files written, in page order.
        problems: input skipped, ``path:line: reason``.
        notes: input merged or read once (duplicate copies, a member's several files).
    """

    html: Path
    mode: str
    plots: list[Plot] = field(default_factory=list)
    pngs: list[Path] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


def _fault_table(rows: list[FaultRow]) -> Table:
    shown = rows[:_FAULT_ROWS]
    cells = [[f"{r.time_s:,.1f}", r.kind, r.member, r.reason, r.detail, r.source] for r in shown]
    if not rows:
        note = ("no fault recorded (leader_events.jsonl, outer_steps.jsonl and the launcher's "
                "events.jsonl; rejected pushes are counted above)")
    else:
        note = (f"the first {_FAULT_ROWS} of {len(rows)}; " if len(rows) > _FAULT_ROWS else "") + \
            "rejected pushes are counted by reason above, not listed"
    return Table("Faults and recoveries", ["time (s since start)", "kind", "member", "reason",
                                           "detail", "from"], cells, note)


def recorded_figures(run: RunFiles) -> tuple[dict[str, Any], list[str]]:
    """The key figures of a run without ``summary.json`` (deployed by hand, or copied from
    its hosts; review 26 M9), under :data:`_SUMMARY_FACTS`' keys, from the leader's files:
    the counts of ``leader.json`` (recounted from ``outer_steps.jsonl`` without it, as
    ``summary.json`` counts per cluster: :func:`dips.algo.pushcounts.push_counts`, the
    rolled-back steps taken back as the leader takes them back), clusters (``leader.json``'s
    ``joined``, else ``run.json``'s config), followers and H from ``run.json``, the initial held-out loss
    from ``run.json`` and the final one from the last evaluation (``eval.jsonl``). Returns
    (figures, the files they came from)."""
    out: dict[str, Any] = {}
    used: list[str] = []
    state = run.leader_state or {}
    counts = state.get("counts") if isinstance(state.get("counts"), dict) else {}
    keys = ("outer_steps", "updates_pushed", "updates_accepted", "updates_rejected",
            "tokens_accepted")
    if got := {k: int(v) for k in keys if (v := num(counts, k)) is not None}:
        out.update(got)
        used.append("leader.json")
    elif run.outer_steps:
        counted = push_counts(run.outer_log)
        totals = counted.totals()
        out.update(outer_steps=counted.outer_steps,
                   **{k: totals[k] for k in keys if k != "outer_steps"})
        used.append("outer_steps.jsonl")
    spec = run.run_spec or {}
    config = spec.get("config") if isinstance(spec.get("config"), dict) else {}
    joined = state.get("joined")
    if isinstance(joined, list) and joined:
        out["clusters"] = len(joined)
    elif isinstance(config.get("clusters"), list):
        out["clusters"] = len(config["clusters"])
    if (n := num(config, "followers")) is not None:
        out["followers"] = int(n)
    if isinstance(config.get("inner"), dict) and (h := num(config["inner"], "H")) is not None:
        out["H"] = int(h)
    if (loss := num(spec, "eval_loss_initial")) is not None:
        out["eval_loss_initial"] = loss
    if config or "eval_loss_initial" in out:
        used.append("run.json")
    if run.evals and (loss := num(run.evals[-1], "eval_loss")) is not None:
        out["eval_loss_final"] = loss
        used.append("eval.jsonl")
    return out, used


def _run_page(run: RunFiles) -> Page:
    page = Page(title=f"dips report: {run.root.name}", problems=run.problems, sources=run.sources,
                merged=run.notes)
    page.notes += run.notes
    s, used = (run.summary, ["summary.json"]) if run.summary is not None else recorded_figures(run)
    page.facts = [(label, _fmt(s[k])) for k, label in _SUMMARY_FACTS if k in s]
    stops = [e.get("reason") for e in run.events if e.get("event") == "stop" and e.get("reason")]
    if stops:
        page.facts.append(("stopped by", str(stops[-1])))
    if reasons := rejections(run):
        page.facts.append(("rejections by reason", ", ".join(f"{k}: {v}" for k, v in reasons.items())))
    rows = fault_rows(run)
    page.facts.append(("faults and recoveries", ", ".join(
        f"{k}: {v}" for k, v in fault_counts(rows).items()) or "none recorded"))
    page.tables.append(_fault_table(rows))
    page.facts.append(("rounds in outer_steps.jsonl", str(len(run.outer_steps))))
    if run.rollbacks:
        page.facts.append(("rolled-back steps", str(len(run.rollbacks))))
    if run.summary is None:
        page.notes.append("no summary.json (a run still going, or a copy without the launcher's "
                          "files): the key figures above come from " + (", ".join(used) or "no file"))
    if not run.outer_steps:
        page.notes.append("no outer_steps.jsonl rounds (the leader's files are missing)")
    if not run.clusters:
        page.notes.append("no cluster train.jsonl found")
    page.sections = [
        ("Loss", [plot_loss_vs_time(run), plot_loss_vs_tokens(run)]),
        ("Rounds", [plot_timeline(run), plot_staleness(run.outer_steps),
                    plot_scores(run.outer_steps, restarts=[
                        t for r in run.leader_events if r.get("event") == "leader_resumed"
                        and (t := num(r, "time")) is not None])]),
        ("Tokens and followers", [plot_tokens_per_cluster(run), plot_followers(run)]),
    ]
    return page


def _compare_page(root: Path, docs: list[Path]) -> Page:
    page = Page(title=f"dips report: comparison {root.name}")
    for path in docs:
        rel = path.parent.relative_to(root)
        prefix = "" if str(rel) == "." else str(rel).replace("/", "_") + "_"
        where = str(path)
        page.sources.append(str(path.relative_to(root)))
        doc = read_json(path, page.problems)
        if doc is None:
            continue
        if isinstance(doc.get("runs"), dict):  # weak scaling: cluster count -> results
            groups = {str(n): curves_of(rs, page.problems, f"{where} runs[{n}]")
                      for n, rs in doc["runs"].items()}
            results = [r for rs in doc["runs"].values() if isinstance(rs, list) for r in rs]
        else:
            groups = {"": curves_of(doc.get("results"), page.problems, where)}
            results = doc.get("results") if isinstance(doc.get("results"), list) else []
        label = str(rel) if prefix else str(doc.get("scenario", root.name))
        for r in results if len(docs) == 1 and "runs" not in doc else []:
            if isinstance(r, dict) and "method" in r:
                page.facts.append((str(r["method"]),
                                   (f"final loss {_fmt(r.get('final_eval_loss'))}, "
                                    f"{_fmt(r.get('tokens_per_s'))} tokens/s, "
                                    f"time {_fmt(r.get('time_s'))} s")))
        plots = plot_compare_losses(groups, prefix, doc.get("mode") == "virtual")
        events = path.parent / "methods" / "di-ps" / "events.jsonl"
        if events.is_file():
            page.sources.append(str(events.relative_to(root)))
            recs = [r for r in read_jsonl(events, page.problems) if "round" in r]
            plots += [plot_staleness(recs, f"{prefix}di-ps_staleness.png"),
                      plot_scores(recs, f"{prefix}di-ps_scores.png")]
        page.sections.append((f"{label} ({doc.get('kind', 'compare')}, {doc.get('mode', '?')} time)",
                              plots))
    return page


#: Files that make a directory a run's (or a comparison's) own: ``dips report DIR`` writes into
#: ``DIR/report/`` by default only when one of them lies at DIR's top.
RUN_MARKERS = ("summary.json", "outer_steps.jsonl", "leader_events.jsonl", "train_start",
               "events.jsonl", "run.json", "leader.json", "compare.json")


class OutRequired(ValueError):
    """``dips report DIR`` without ``--out`` on a directory that is not itself a run's: its
    files lie only in folders below (a copy from several hosts, or a directory such as /tmp
    that holds runs), so the report would land somewhere unexpected."""


def default_out(run_dir: Path) -> Path:
    """Where the report of ``run_dir`` goes without ``--out``: ``run_dir/report/`` (a folder
    of its own, never among the run's files). Raises OutRequired when ``run_dir`` is not
    itself a run's or comparison's directory (no :data:`RUN_MARKERS` file at its top, nor a
    ``compare.json`` one folder below), naming what it holds below."""
    run_dir = Path(run_dir)
    if any((run_dir / m).is_file() for m in RUN_MARKERS) or any(
            p.is_file() for p in run_dir.glob("*/compare.json")):
        return run_dir / "report"
    below = sorted({str(p.parent) for m in RUN_MARKERS for p in find(run_dir, m)})
    where = (f"its run files lie below, in {', '.join(below[:5])}"
             f"{' …' if len(below) > 5 else ''}" if below else "it holds no run's files")
    raise OutRequired(f"{run_dir} is not a run directory ({where}): give --out DIR, the "
                      f"folder report.html and the PNGs go to")


def write_report(run_dir: Path, out_dir: Path | None = None) -> Report:
    """Write ``report.html`` and the PNGs of ``run_dir`` into ``out_dir`` (default:
    :func:`default_out`, ``run_dir/report/``).

    Raises NotADirectoryError if ``run_dir`` is not a directory; OutRequired (a ValueError)
    without ``out_dir`` when ``run_dir`` is not itself a run's directory; SeveralRuns (a
    ValueError, naming the files) when it holds the files of several runs. Nothing else in
    its content makes it raise: a missing piece becomes a note on the page, a bad line a
    ``problems`` entry, duplicate copies of a file are read once (``notes``).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise NotADirectoryError(f"{run_dir}: not a directory (give a run or comparison directory)")
    out_dir = Path(out_dir) if out_dir is not None else default_out(run_dir)
    top = run_dir / "compare.json"
    docs = [top] if top.is_file() else find(run_dir, "compare.json")
    if docs:
        page, mode = _compare_page(run_dir, docs), "compare"
        page.notes.append(f"comparison output ({len(docs)} compare.json): loss curves per method")
    else:
        page, mode = _run_page(load_run(run_dir)), "run"
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(html=out_dir / "report.html", mode=mode, problems=page.problems,
                    notes=page.merged)
    written: dict[str, Path] = {}
    for _, plots in page.sections:
        for plot in plots:
            report.plots.append(plot)
            if (path := plot.save(out_dir)) is not None:
                written[plot.name] = path
                report.pngs.append(path)
    report.html.write_text(render(page, written), encoding="utf-8")
    return report
