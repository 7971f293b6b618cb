"""What every plot of the report shares: the :class:`Plot` record, figure creation, series count.

Figures are :class:`matplotlib.figure.Figure` objects made without pyplot (no global state,
nothing to close; PNGs are drawn by the Agg canvas), so a plot function can be called and
inspected in a test.  A *series* is one labelled artist of the figure (a line, a set of bars,
a scatter, a threshold line), as the legend lists them; :func:`count_series` counts them, and
:attr:`Plot.series` is that count, which the tests compare with what the input holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")  # files only; never a display

from matplotlib.axes import Axes  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import EngFormatter  # noqa: E402

from dips.bench import curves as curves_rule  # noqa: E402

__all__ = ["DOWN_COLOUR", "LossCurve", "Plot", "count_series", "draw_losses", "empty_plot", "mark_at",
           "mark_stop", "new_figure", "smooth", "time_axis", "tokens_axis"]

DPI = 100  # dots per inch of the PNGs
#: The colour of a stretch a member was down, in every plot that shows one.
DOWN_COLOUR = "#a50f15"


@dataclass
class Plot:
    """One figure of the report.

    Attributes:
        name: the PNG's file name in the output directory, e.g. ``loss_vs_time.png``.
        title: the heading above it in the HTML.
        figure: the figure, or None when the run holds nothing to draw (see ``note``).
        series: labelled series in the figure (:func:`count_series`).
        note: what is missing or approximate, shown under the figure (None: nothing).
    """

    name: str
    title: str
    figure: Figure | None
    series: int = 0
    note: str | None = None

    def save(self, out_dir: Path) -> Path | None:
        """Write the PNG into ``out_dir`` (None without a figure); returns its path."""
        if self.figure is None:
            return None
        path = Path(out_dir) / self.name
        self.figure.savefig(path, dpi=DPI, format="png")
        return path


def new_figure(ncols: int = 1, width_in: float = 8.0, height_in: float = 4.2,
               nrows: int = 1) -> tuple[Figure, list[Axes]]:
    """A figure of ``nrows`` × ``ncols`` axes (sizes in inches) on an Agg canvas; the axes in
    row order."""
    fig = Figure(figsize=(width_in, height_in), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def count_series(fig: Figure) -> int:
    """Labelled artists over all axes of ``fig`` (each label counted once per axes)."""
    total = 0
    for ax in fig.axes:
        _, labels = ax.get_legend_handles_labels()
        total += len(dict.fromkeys(labels))
    return total


def finish(name: str, title: str, fig: Figure, note: str | None = None) -> Plot:
    """A :class:`Plot` of ``fig`` with legends drawn on every axes that has labels."""
    for ax in fig.axes:
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    return Plot(name, title, fig, count_series(fig), note)


def empty_plot(name: str, title: str, note: str) -> Plot:
    """A plot the run has no data for: no figure, only ``note`` in the HTML."""
    return Plot(name, title, None, 0, note)


def time_axis(span_s: float) -> tuple[float, str]:
    """(divisor, unit) to show seconds of a run lasting ``span_s`` seconds: s, min, h or days."""
    for div, unit in ((86400.0, "days"), (3600.0, "h"), (60.0, "min")):
        if span_s >= 3 * div:
            return div, unit
    return 1.0, "s"


def mark_at(ax: Axes, xs: Sequence[float], label: str) -> None:
    """A dotted vertical line at each of ``xs`` (data x), the legend naming them once as
    ``label`` (e.g. the leader's restarts); nothing without ``xs``."""
    for i, x in enumerate(xs):
        ax.axvline(x, color="0.35", linestyle=":", linewidth=1.2, label=label if i == 0 else "_")


def mark_stop(ax: Axes, stop_s: float | None, reason: str | None, div: float = 1.0,
              lo: float = 0.0, hi: float = math.inf, label: bool = True,
              end_s: float | None = None) -> None:
    """A dashed black vertical line where training stopped (``stop_s`` seconds since the
    start, drawn at ``stop_s / div``) when it lies in ``lo``..``hi`` seconds, labelled
    "training stopped (``reason``)" when ``label``, and the shutdown after it until the run's
    end ``end_s`` shaded light grey, behind everything; nothing for a ``stop_s`` of None."""
    if stop_s is None or not lo <= stop_s <= hi:
        return
    why = f" ({reason})" if reason else ""
    shaded = end_s is not None and end_s > stop_s
    ax.axvline(stop_s / div, color="black", linestyle="--", linewidth=1.2,
               label=(f"training stopped{why}" + ("; shutdown shaded" if shaded else ""))
               if label else "_")
    if shaded:
        ax.axvspan(stop_s / div, min(end_s, hi) / div, facecolor="0.93", edgecolor="none",
                   zorder=0, label="_")


def tokens_axis(axis: object) -> None:
    """Token counts on ``axis`` (an x or y axis) as 500k, 1.2M instead of long integers."""
    axis.set_major_formatter(EngFormatter(sep=""))  # type: ignore[attr-defined]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points (fewer at the start), same length as ``values``."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


@dataclass
class LossCurve:
    """One loss curve of a plot (:func:`draw_losses`).

    Attributes:
        label: its legend label (`` (diverged)`` is appended when it diverged).
        x / y: the points; y in nats/token, NaN where the line breaks (a process restart).
        style: matplotlib line keywords (e.g. :func:`dips.bench.curves.method_style`).
        judged: the losses :func:`dips.bench.curves.diverged` judges (default: ``y``); a
            curve with breaks passes its values without them.
    """

    label: str
    x: Sequence[float]
    y: Sequence[float]
    style: dict[str, Any] = field(default_factory=dict)
    judged: Sequence[float] | None = None

    def losses(self) -> Sequence[float]:
        return self.y if self.judged is None else self.judged


def draw_losses(ax: Axes, curves: Sequence[LossCurve], marker: str | None = ".") -> list[str]:
    """Draw loss curves on ``ax`` with the one rule of every dips loss plot (issue 15): the
    y-range spans the curves that converge (:func:`dips.bench.curves.loss_range`); a curve
    that diverged (:func:`dips.bench.curves.diverged`) is drawn, labelled "(diverged)" and
    marked by an arrow at its last point inside the range with its final loss, and never
    rescales the others. Returns the labels of the diverged curves, in order."""
    limits = curves_rule.loss_range(c.losses() for c in curves)
    bad = [c for c in curves if c.y and curves_rule.diverged(c.losses())]
    for c in curves:
        if not c.y:
            continue
        label = f"{c.label} (diverged)" if any(c is b for b in bad) else c.label
        ax.plot(list(c.x), list(c.y), label=label, **{"marker": marker, "markersize": 3,
                                                      **c.style})
    if limits is not None:
        ax.set_ylim(*limits)
    for k, c in enumerate(bad):
        _mark_diverged(ax, c, k)
    return [c.label for c in bad]


def _mark_diverged(ax: Axes, c: LossCurve, k: int) -> None:
    """Arrow at the last point of ``c`` inside the y-range (after it, the curve stays out of
    range), with its final loss; ``k`` staggers the notes of several diverged curves."""
    lo, hi = ax.get_ylim()
    xs, ys = list(c.x), list(c.y)
    inside = [i for i, y in enumerate(ys) if math.isfinite(y) and lo <= y <= hi]
    last = inside[-1] if inside else None
    x, y = (xs[last], ys[last]) if last is not None else (xs[0], hi)
    x0, x1 = ax.get_xlim()
    right = x1 > x0 and (x - x0) / (x1 - x0) > 0.5
    losses = list(c.losses())
    end = losses[-1] if losses else math.nan
    final = f"{end:,.2f}" if math.isfinite(end) else str(end)
    ax.annotate(f"{c.label} diverged: final loss {final}", xy=(x, y),
                xytext=(-12 if right else 12, -30 - 16 * k), textcoords="offset points",
                ha="right" if right else "left", va="top", fontsize=8, color="C3",
                arrowprops={"arrowstyle": "->", "color": "C3"},
                bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "C3", "alpha": 0.9})
