"""``dips place``: choose where to put the parameter server (§10 of the seed).

``dips place --bandwidth B.csv --throughput p.csv`` reads

* ``B.csv``: one row per candidate PS location, one column per training cluster, the
  bandwidth from that location to that cluster (any unit, e.g. Gbit/s). An optional header
  row names the clusters; an optional first column names the candidates.
* ``p.csv``: each cluster's training throughput (any unit, e.g. tokens/s), in the same
  cluster order: one row of M values, or M rows of one value (optionally ``name,value``), with
  an optional header row.

and prints the score B[i,·]·p of every candidate and i* = argmax_i B[i,·]·p
(:func:`dips.algo.best_placement`). A malformed file is refused with its name, row and
column, and exit status 2. Blank lines and lines starting with ``#`` are ignored.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import typer


class CsvError(ValueError):
    """A CSV input that cannot be used; the message names the file, row and column."""


def _number(cell: str) -> float | None:
    try:
        v = float(cell)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def _rows(path: Path) -> list[tuple[int, list[str]]]:
    try:
        with open(path, newline="") as f:
            rows = [(i, [c.strip() for c in row]) for i, row in enumerate(csv.reader(f), 1)]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise CsvError(f"{path}: cannot read: {exc}") from None
    rows = [(i, r) for i, r in rows if any(r) and not r[0].startswith("#")]
    if not rows:
        raise CsvError(f"{path}: no data rows")
    return rows


def _values(path: Path, lineno: int, cells: list[str], first_col: int) -> list[float]:
    out = []
    for j, cell in enumerate(cells[first_col:], first_col + 1):
        v = _number(cell)
        if v is None or v < 0:
            raise CsvError(f"{path} row {lineno}, column {j}: {cell!r} is not a finite number >= 0")
        out.append(v)
    return out


def read_bandwidth(path: Path) -> tuple[list[str], list[list[float]]]:
    """(candidate names, N×M matrix) from ``B.csv``. Raises CsvError naming row/column."""
    rows = _rows(path)
    if any(_number(c) is None for c in rows[0][1][1:]) or (
            len(rows) > 1 and _number(rows[0][1][0]) is None and _number(rows[1][1][0]) is not None):
        rows = rows[1:]  # a header row naming the clusters
        if not rows:
            raise CsvError(f"{path}: a header row but no data rows")
    labelled = all(_number(r[0]) is None for _, r in rows)
    names, matrix = [], []
    for lineno, cells in rows:
        values = _values(path, lineno, cells, 1 if labelled else 0)
        if matrix and len(values) != len(matrix[0]):
            raise CsvError(f"{path} row {lineno} has {len(values)} bandwidths, the first data row "
                           f"has {len(matrix[0])}")
        if not values:
            raise CsvError(f"{path} row {lineno} has no bandwidths")
        names.append(cells[0] if labelled else str(len(matrix)))
        matrix.append(values)
    return names, matrix


def read_throughput(path: Path) -> list[float]:
    """M throughputs from ``p.csv`` (one row, or one value per row). Raises CsvError."""
    rows = _rows(path)
    if all(_number(c) is None for c in rows[0][1]):
        rows = rows[1:]  # header
        if not rows:
            raise CsvError(f"{path}: a header row but no data rows")
    if len(rows) == 1:
        lineno, cells = rows[0]
        return _values(path, lineno, cells, 1 if _number(cells[0]) is None else 0)
    out = []
    for lineno, cells in rows:
        values = _values(path, lineno, cells, 1 if _number(cells[0]) is None else 0)
        if len(values) != 1:
            raise CsvError(f"{path} row {lineno} has {len(values)} values; with several rows each "
                           f"row holds one cluster's throughput")
        out.extend(values)
    return out


def place(bandwidth: Path = typer.Option(..., "--bandwidth", dir_okay=False,
                                         help="CSV: candidates x clusters bandwidth matrix B."),
          throughput: Path = typer.Option(..., "--throughput", dir_okay=False,
                                          help="CSV: per-cluster training throughput p.")) -> None:
    """Print B[i,·]·p for every candidate PS location and the best one, i* (§10)."""
    from rich.console import Console
    from rich.table import Table

    from dips.algo import best_placement

    console = Console()
    try:
        names, B = read_bandwidth(bandwidth)
        p = read_throughput(throughput)
        if len(p) != len(B[0]):
            raise CsvError(f"{throughput} has {len(p)} throughputs but {bandwidth} has "
                           f"{len(B[0])} cluster columns")
        best, scores = best_placement(B, p)
    except (CsvError, ValueError) as exc:
        typer.echo(f"dips place: {exc}", err=True)
        raise typer.Exit(2)
    table = Table(title="PS placement: score_i = B\\[i,·]·p (§10)")
    table.add_column("i", justify="right")
    table.add_column("candidate")
    table.add_column("score", justify="right")
    table.add_column("")
    for i, (name, s) in enumerate(zip(names, scores)):
        table.add_row(str(i), name, f"{s:.6g}", "<- i*" if i == best else "")
    console.print(table)
    console.print(f"i* = {best} ({names[best]}), score {scores[best]:.6g}")
