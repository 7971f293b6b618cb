"""PNG plots of ``dips bench compare`` (matplotlib, Agg backend; seed §14's curves).

* ``loss_vs_tokens.png`` / ``loss_vs_time.png``: validation loss (nats/token) of every method
  against tokens consumed and against (virtual) seconds. The y-range comes from the methods
  that converge; a method that diverged (:func:`diverged`) is drawn, but clipped to that
  range, labelled "(diverged)" and marked by an arrow, at its last point in range, that
  gives its final loss, so one blown-up ablation never flattens the others' curves (one
  rule for every loss plot: :func:`dips.bench.runreport.figs.draw_losses`);
* ``throughput.png``: aggregate tokens/s per method (bars), DiLoCo's as a dashed line;
* weak scaling: ``weak_scaling.png`` (aggregate tokens/s against clusters, with the ideal) and
  ``weak_scaling_efficiency.png`` (% of the ideal).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a display

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from dips.bench import curves  # noqa: E402
from dips.bench.runreport.figs import LossCurve, draw_losses  # noqa: E402
from dips.emu.result import MethodResult  # noqa: E402

__all__ = ["diverged", "loss_figure", "loss_range", "plot_compare", "plot_weak_scaling"]


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def diverged(result: MethodResult) -> bool:
    """Whether ``result``'s validation-loss curve diverged (:func:`dips.bench.curves.diverged`)."""
    return curves.diverged([p.eval_loss for p in result.curve])


def loss_range(results: list[MethodResult]) -> tuple[float, float] | None:
    """The y-range (nats/token) of the loss plots (:func:`dips.bench.curves.loss_range`)."""
    return curves.loss_range([p.eval_loss for p in r.curve] for r in results)


def loss_figure(results: list[MethodResult], key: str, xlabel: str, title: str) -> Figure:
    """One loss plot: validation loss (nats/token) of every method against ``key`` (``tokens``
    or ``time_s``, seconds) as an open Figure (the caller saves and closes it). The y-range is
    :func:`loss_range`; each diverged method is labelled and annotated, never rescaling it."""
    fig, ax = plt.subplots(figsize=(8.6, 4.2))
    draw_losses(ax, [LossCurve(r.method, [getattr(p, key) for p in r.curve],
                               [p.eval_loss for p in r.curve], curves.method_style(r.method))
                     for r in results])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(f"{title}: validation loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside: notes stay clear
    return fig


def plot_compare(results: list[MethodResult], out_dir: Path, title: str) -> list[str]:
    """Write the three comparison plots into ``out_dir``; returns their file names."""
    virtual = bool(results) and results[0].mode == "virtual"
    axes = (("tokens", "tokens consumed (all clusters)", "loss_vs_tokens.png"),
            ("time_s", "time (s, virtual)" if virtual else "time (s)", "loss_vs_time.png"))
    names = [_save(loss_figure(results, key, label, title), out_dir / fname)
             for key, label, fname in axes]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    labels = [r.method for r in results]
    ax.bar(labels, [r.tokens_per_s for r in results],
           color=["C3" if m == "di-ps" else "C0" for m in labels])
    ref = next((r for r in results if r.method == "diloco"), None)
    if ref is not None:
        ax.axhline(ref.tokens_per_s, color="k", linestyle="--", linewidth=1, label="sync DiLoCo")
        ax.legend(fontsize=8)
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title(f"{title}: throughput")
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    names.append(_save(fig, out_dir / "throughput.png"))
    return names


def plot_weak_scaling(points: list[dict[str, Any]], out_dir: Path, title: str) -> list[str]:
    """Write the weak-scaling plots into ``out_dir``; returns their file names."""
    methods = list(dict.fromkeys(p["method"] for p in points))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ideal = {}
    for p in points:
        ideal.setdefault(p["clusters"], p["ideal_tokens_per_s"])
    ns = sorted(ideal)
    ax.plot(ns, [ideal[n] for n in ns], "k--", label="ideal (independent, no outer comm.)")
    for m in methods:
        pts = sorted((p["clusters"], p["tokens_per_s"]) for p in points if p["method"] == m)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=m, **curves.method_style(m))
    ax.set_xlabel("clusters")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title(f"{title}: weak scaling")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    names = [_save(fig, out_dir / "weak_scaling.png")]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for m in methods:
        pts = sorted((p["clusters"], 100 * (p["frac_of_ideal"] or 0)) for p in points
                     if p["method"] == m)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=m, **curves.method_style(m))
    ax.axhline(97, color="grey", linestyle=":", linewidth=1, label="97% target")
    ax.set_xlabel("clusters")
    ax.set_ylabel("% of ideal throughput")
    ax.set_title(f"{title}: efficiency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    names.append(_save(fig, out_dir / "weak_scaling_efficiency.png"))
    return names
