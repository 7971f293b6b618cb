"""``dips report RUN_DIR [--out DIR]``: the command (typer); matplotlib is imported only when it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

__all__ = ["report"]

_SHOWN = 20  # skipped lines echoed on stderr (all of them are on the page)


def report(run_dir: Path = typer.Argument(..., exists=True, file_okay=False, metavar="RUN_DIR",
                                          help="A run directory (dips launch, or copies of each "
                                               "host's state directory) or a dips bench compare "
                                               "output."),
           out: Optional[Path] = typer.Option(None, "--out",
                                              help="The folder report.html and the PNGs go "
                                                   "to (default: RUN_DIR/report, and only "
                                                   "when RUN_DIR is a run's own directory)."
                                              )) -> None:
    """Write report.html (self-contained, plots embedded) and the plots as PNGs."""
    from dips.bench.runreport.build import OutRequired, SeveralRuns, write_report
    from dips.wire.ratelog import printable  # the files quote members' text (review 21, F4)

    try:
        rep = write_report(run_dir, out)
    except (OSError, OutRequired, SeveralRuns) as exc:  # an output that cannot be written,
        typer.echo(f"dips report: {printable(str(exc))}", err=True)  # no --out, several runs
        raise typer.Exit(2)
    for line in rep.notes:
        typer.echo(f"note: {printable(line)}", err=True)
    for line in rep.problems[:_SHOWN]:
        typer.echo(f"skipped: {printable(line)}", err=True)
    if len(rep.problems) > _SHOWN:
        typer.echo(f"... and {len(rep.problems) - _SHOWN} more (listed in the report)", err=True)
    typer.echo(f"{rep.html} ({rep.mode}: {len(rep.pngs)} plots)")
