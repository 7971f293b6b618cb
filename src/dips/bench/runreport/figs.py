"""What every plot of the report shares: the :class:`Plot` record, figure creation, series count.

Figures are :class:`matplotlib.figure.Figure` objects made without pyplot (no global state,
nothing to close; PNGs are drawn by the Agg canvas), so a plot function can be called and
inspected in a test.  A *series* is one labelled artist of the figure (a line, a set of bars,
a scatter, a threshold line), as the legend lists them; :func:`count_series` counts them, and
:attr:`Plot.series` is that count, which the tests compare with what the input holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display

from matplotlib.axes import Axes  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import EngFormatter  # noqa: E402

__all__ = ["Plot", "count_series", "empty_plot", "new_figure", "smooth", "time_axis", "tokens_axis"]

DPI = 100  # dots per inch of the PNGs


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
