"""The plots of a ``dips bench compare`` output (``compare.json``): loss curves per method.

* ``loss_vs_tokens.png`` / ``loss_vs_time.png``: each method's held-out loss (nats/token)
  against tokens consumed and against (virtual) seconds.  The y-axis spans the methods that
  converge; a method that diverged (:func:`dips.bench.curves.diverged`) is drawn, marked at
  its last point inside that range with an arrow and its final loss, so it never flattens the
  others' curves (:func:`dips.bench.runreport.figs.draw_losses`, the rule of every loss plot).
* a weak-scaling output (``runs``: cluster count → results) gives one axes per cluster count.
* the ``di-ps`` method's ``methods/di-ps/events.jsonl`` gives the staleness and score plots of
  :mod:`dips.bench.runreport.round_plots`.

Curve points are ``{"time_s", "tokens", "eval_loss"}`` (``dips.emu.result.MethodResult``);
a point without them is skipped and listed among the page's skipped input.
"""

from __future__ import annotations

from typing import Any

from matplotlib.axes import Axes

from dips.bench import curves as curves_rule
from dips.bench.runreport.figs import (
    LossCurve,
    Plot,
    draw_losses,
    empty_plot,
    finish,
    new_figure,
    tokens_axis,
)
from dips.bench.runreport.files import num

__all__ = ["curves_of", "diverged", "plot_compare_losses"]

Curve = list[tuple[float, float, float]]  # (time s, tokens, eval loss)


def curves_of(results: Any, problems: list[str], where: str) -> dict[str, Curve]:
    """Method → its curve points, from a ``results`` list (bad entries reported in ``problems``
    as ``where: results[i]...``)."""
    out: dict[str, Curve] = {}
    if not isinstance(results, list):
        problems.append(f"{where}: results is not a list; no loss curves")
        return out
    for i, r in enumerate(results):
        if not isinstance(r, dict) or not isinstance(r.get("method"), str):
            problems.append(f"{where}: results[{i}] has no method name; skipped")
            continue
        pts: Curve = []
        for j, p in enumerate(r.get("curve") or []):
            vals = [num(p, k) if isinstance(p, dict) else None for k in ("time_s", "tokens")]
            loss = p.get("eval_loss") if isinstance(p, dict) else None
            if None in vals or not isinstance(loss, (int, float)) or isinstance(loss, bool):
                problems.append(f"{where}: results[{i}].curve[{j}] lacks time_s/tokens/eval_loss; "
                                "point skipped")
                continue
            pts.append((vals[0], vals[1], float(loss)))
        out[r["method"]] = pts
    return out


def diverged(curve: Curve) -> bool:
    """Whether a method's curve diverged (:func:`dips.bench.curves.diverged`)."""
    return curves_rule.diverged([p[2] for p in curve])


def _draw(ax: Axes, curves: dict[str, Curve], key: int) -> None:
    draw_losses(ax, [LossCurve(m, [p[key] for p in c], [p[2] for p in c],
                               curves_rule.method_style(m)) for m, c in curves.items()])
    ax.set_ylabel("held-out loss (nats/token)")


def plot_compare_losses(groups: dict[str, dict[str, Curve]], prefix: str, virtual: bool) -> list[Plot]:
    """``loss_vs_tokens`` and ``loss_vs_time`` plots: one axes per group (a cluster count of
    a weak-scaling output, or one group ``""``), one series per method."""
    groups = {g: c for g, c in groups.items() if any(c.values())}
    out = []
    for key, xlabel, stem in ((1, "tokens consumed (all clusters)", "loss_vs_tokens"),
                              (0, "time (s, virtual)" if virtual else "time (s)", "loss_vs_time")):
        name, title = f"{prefix}{stem}.png", f"Held-out loss against {xlabel.split(' (')[0]}"
        if not groups:
            out.append(empty_plot(name, title, "no method with a loss curve in compare.json"))
            continue
        fig, axes = new_figure(ncols=min(3, len(groups)), nrows=-(-len(groups) // 3),
                               width_in=8.0 if len(groups) == 1 else 14.0,
                               height_in=4.6 * -(-len(groups) // 3))
        for ax, (g, curves) in zip(axes, groups.items()):
            _draw(ax, curves, key)
            ax.set_xlabel(xlabel)
            ax.set_title(f"{g} cluster{'' if g == '1' else 's'}" if g else title)
            if key == 1:
                tokens_axis(ax.xaxis)
        for ax in axes[len(groups):]:
            ax.set_visible(False)
        bad = sorted(m for c in groups.values() for m, cv in c.items() if diverged(cv))
        out.append(finish(name, title, fig, f"diverged: {', '.join(dict.fromkeys(bad))} (marked; "
                                            "the y-axis follows the methods that converge)"
                          if bad else None))
    return out
