"""``report.html``: one self-contained page (inline CSS, every PNG a base64 ``data:`` URI).

The page has a title, a table of key figures, the notes on what the run lacks, tables (the
run's faults), one section per group of plots (each plot with its heading, the image and its
note), and the lines of the input files that were skipped (``path:line: reason``).  Nothing refers outside the file: no
script, no external style sheet, font or image.  Every text is HTML-escaped.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from html import escape as _html_escape
from pathlib import Path

from dips.bench.runreport.figs import Plot
from dips.wire.ratelog import printable

__all__ = ["Page", "Table", "render"]

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1150px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ccc; margin-top: 1.6em; }
h3 { font-size: 1.0em; margin-bottom: 0.3em; }
table { border-collapse: collapse; font-size: 0.9em; }
td, th { border: 1px solid #ddd; padding: 2px 8px; text-align: left; }
img { max-width: 100%; border: 1px solid #eee; }
.note { color: #8a5a00; font-size: 0.9em; }
.problems { font-family: monospace; font-size: 0.85em; color: #a00; }
"""


def escape(text: object) -> str:
    """``text`` for the page: HTML-escaped, and control characters (ESC, BEL: the run's files
    hold members' text) replaced as in the terminal (:func:`dips.wire.ratelog.printable`),
    which HTML does not allow (review 26, M8)."""
    return _html_escape(printable(str(text)))


@dataclass
class Table:
    """A table of the page: ``heading`` (an ``<h2>``), ``columns``, ``rows`` of cells (text),
    and a ``note`` under it (None: none)."""

    heading: str
    columns: list[str]
    rows: list[list[str]]
    note: str | None = None


@dataclass
class Page:
    """What :func:`render` puts on the page.

    Attributes:
        title: the page title (``<title>`` and ``<h1>``).
        facts: (label, value) rows of the key-figures table.
        tables: :class:`Table` s, after the notes.
        sections: (heading, plots) in page order.
        notes: page-level notes (missing files, the mode the report ran in).
        problems: skipped input, ``path:line: reason``.
        sources: the files read, relative to the run directory.
        merged: input merged or read once (also in ``notes``; the command echoes them).
    """

    title: str
    facts: list[tuple[str, str]] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    sections: list[tuple[str, list[Plot]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    merged: list[str] = field(default_factory=list)


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{data}">'


def _list(items: list[str], cls: str = "") -> str:
    attr = f' class="{cls}"' if cls else ""
    return f"<ul{attr}>" + "".join(f"<li>{escape(i)}</li>" for i in items) + "</ul>"


def render(page: Page, pngs: dict[str, Path]) -> str:
    """The HTML of ``page``; ``pngs`` maps a plot's name to its written PNG (plots without one
    show only their note)."""
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           f"<title>{escape(page.title)}</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
           f"<h1>{escape(page.title)}</h1>"]
    if page.facts:
        out.append("<table>" + "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>"
                                       for k, v in page.facts) + "</table>")
    if page.notes:
        out += ["<h2>Notes</h2>", _list(page.notes, "note")]
    for t in page.tables:
        out.append(f"<h2>{escape(t.heading)}</h2>")
        if t.rows:
            out.append("<table><tr>" + "".join(f"<th>{escape(c)}</th>" for c in t.columns)
                       + "</tr>" + "".join("<tr>" + "".join(f"<td>{escape(v)}</td>" for v in r)
                                           + "</tr>" for r in t.rows) + "</table>")
        if t.note:
            out.append(f'<p class="note">{escape(t.note)}</p>')
    for heading, plots in page.sections:
        out.append(f"<h2>{escape(heading)}</h2>")
        for plot in plots:
            out.append(f"<h3>{escape(plot.title)}</h3>")
            if plot.name in pngs:
                out.append(f"<p>{_img(pngs[plot.name], plot.title)}</p>")
            if plot.note:
                out.append(f'<p class="note">{escape(plot.note)}</p>')
    if page.problems:
        out += [f"<h2>Skipped input ({len(page.problems)})</h2>", _list(page.problems, "problems")]
    if page.sources:
        out += ["<h2>Files read</h2>", _list(page.sources)]
    out += ["</body>", "</html>"]
    return "\n".join(out) + "\n"
