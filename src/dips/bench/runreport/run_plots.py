"""The loss, token and follower plots of one run (``dips report`` on a run directory).

* ``loss_vs_time.png``: each cluster's training loss (nats/token, a trailing mean over its
  inner steps) and the global model's held-out loss against seconds since the training start;
* ``loss_vs_tokens.png``: left, each cluster's training loss against the tokens it trained on
  (across restarts of its process); right, the held-out loss against tokens accepted into the
  global model; a cluster's line breaks between two of its processes (:meth:`ClusterSteps.
  lines`);
* ``tokens_per_cluster.png``: tokens each cluster trained on and tokens accepted from it;
  ``followers.png`` is :mod:`dips.bench.runreport.followers`.

Held-out points: :func:`dips.bench.runreport.heldout.heldout_points`, and under
``loss_vs_time.png`` a note on which versions the series holds
(:func:`dips.bench.runreport.heldout.heldout_note`). ``loss_vs_time.png`` spans the whole
run (:func:`dips.bench.runreport.span.run_span`, review 33 M2), the stop marked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from dips.algo.consumed import consumed_series, tokens_consumed_of
from dips.algo.pushcounts import push_counts
from dips.bench.runreport.figs import (
    LossCurve,
    Plot,
    draw_losses,
    empty_plot,
    finish,
    mark_stop,
    new_figure,
    smooth,
    time_axis,
    tokens_axis,
)
from dips.bench.runreport.files import RunFiles, num
from dips.bench.runreport.heldout import heldout_note, heldout_points
from dips.bench.runreport.span import run_span

__all__ = ["ClusterSteps", "cluster_steps", "heldout_points", "plot_loss_vs_time",
           "plot_loss_vs_tokens", "plot_tokens_per_cluster"]


@dataclass
class ClusterSteps:
    """One cluster's inner steps: seconds since the start, cumulative tokens (across process
    restarts: a count that falls back starts a new lifetime on top of the last), loss; and
    ``lifetimes``, the index of each process's first step (a ``join`` record starts one), and
    of the first step after a re-join of the same process (``rejoin``: it pulled the global
    model and trained nothing while removed, so its line breaks there too)."""

    time_s: list[float]
    tokens: list[float]
    loss: list[float]
    lifetimes: list[int] = field(default_factory=list)

    def lines(self, xs: list[float], window: int) -> tuple[list[float], list[float]]:
        """(x, trailing-mean loss) to plot against ``xs`` (one x per step), each process's
        steps smoothed on their own and NaN between processes, so that the line breaks where
        a process died and its successor started (review 15, #10), never drawn across it."""
        out_x: list[float] = []
        out_y: list[float] = []
        bounds = [*self.lifetimes, len(self.loss)]
        for lo, hi in zip(bounds, bounds[1:]):
            if hi <= lo:
                continue
            if out_x:
                out_x.append(math.nan)
                out_y.append(math.nan)
            out_x += xs[lo:hi]
            out_y += smooth(self.loss[lo:hi], window)
        return out_x, out_y


def cluster_steps(run: RunFiles, records: list[dict[str, Any]]) -> ClusterSteps:
    """The inner-step records of one ``train.jsonl`` (records without ``loss`` or ``time``
    skipped), their tokens counted over every process as ``summary.json`` counts them
    (:func:`dips.algo.consumed.consumed_series`: a resumed process counts on from its saved
    count, so no token is counted twice)."""
    steps = {st.index: st for st in consumed_series(records)}
    out = ClusterSteps([], [], [], [0])
    process, breaks = 0, False  # breaks: the next step starts a line of its own
    for i, rec in enumerate(records):
        breaks |= rec.get("event") == "join" and rec.get("rejoin") is True
        st = steps.get(i)
        if st is not None and st.process != process:
            process, breaks = st.process, True  # a new process of this cluster
        if st is None or (loss := num(rec, "loss")) is None or (t := num(rec, "time")) is None:
            continue
        if breaks and out.lifetimes[-1] < len(out.loss):
            out.lifetimes.append(len(out.loss))
        breaks = False
        out.time_s.append(run.rel(t))
        out.tokens.append(float(st.tokens))
        out.loss.append(loss)
    return out


def _window(n: int) -> int:
    return max(1, min(30, n // 10))


def _losses(run: RunFiles, by_time: bool) -> tuple[dict, list[tuple[float, float]]]:
    """({cluster id: its steps} of the clusters whose train.jsonl has losses, sorted by id;
    [(seconds or tokens accepted, held-out loss)] of the evaluations that have that x)."""
    steps = {cid: cluster_steps(run, recs) for cid, recs in sorted(run.clusters.items())}
    held = [(t if by_time else k, v) for t, k, v in heldout_points(run)
            if (t if by_time else k) is not None]
    return {cid: s for cid, s in steps.items() if s.loss}, held


def _training_curves(steps: dict[str, ClusterSteps], xs: Callable[[ClusterSteps], list[float]],
                     suffix: str) -> list[LossCurve]:
    """Each cluster's smoothed training loss against ``xs`` of its steps (a break between
    its processes); whether it diverged is judged on the smoothed values."""
    out = []
    for cid, s in steps.items():
        x, y = s.lines(xs(s), _window(len(s.loss)))
        out.append(LossCurve(f"{cid}{suffix}", x, y, {"linewidth": 1.0},
                             judged=[v for v in y if not math.isnan(v)]))
    return out


def _heldout_curve(held: list[tuple[float, float]]) -> list[LossCurve]:
    if not held:
        return []
    return [LossCurve("global model, held-out", [x for x, _ in held], [v for _, v in held],
                      {"color": "k", "marker": "o", "markersize": 5, "linewidth": 1.6})]


def _diverged_note(bad: list[str]) -> list[str]:
    if not bad:
        return []
    return [f"diverged: {', '.join(bad)} (marked; the y-axis follows the curves that converge)"]


def _no_losses(name: str, title: str) -> Plot:
    return empty_plot(name, title,
                      "no cluster train.jsonl with losses and no held-out evaluation found")


def plot_loss_vs_time(run: RunFiles) -> Plot:
    """Training loss per cluster and held-out loss against seconds since the start."""
    title = "Loss against wall time"
    steps, held = _losses(run, by_time=True)
    if not steps and not held:
        return _no_losses("loss_vs_time.png", title)
    span = run_span(run)
    end = max([t for s in steps.values() for t in s.time_s] + [t for t, _ in held] + [span.end])
    div, unit = time_axis(end)
    fig, (ax,) = new_figure()
    bad = draw_losses(ax, [*_training_curves(steps, lambda s: [t / div for t in s.time_s],
                                             " training loss"),
                           *_heldout_curve([(t / div, v) for t, v in held])], marker=None)
    mark_stop(ax, span.stop, span.stop_reason, div, end_s=end)
    ax.set_xlim(0.0, end / div)
    ax.set_xlabel(f"wall time since the training start ({unit})")
    ax.set_ylabel("loss (nats/token)")
    notes = [] if held else ["no held-out evaluation in the run (summary.json eval_loss_*)"]
    if (what := heldout_note(run)) is not None:
        notes.append(what)
    if not steps:
        notes.append("no cluster training losses found (train.jsonl)")
    notes += _diverged_note(bad)
    ax.set_title(title)
    return finish("loss_vs_time.png", title, fig, "; ".join(notes) or None)


def plot_loss_vs_tokens(run: RunFiles) -> Plot:
    """Training loss per cluster against its tokens; held-out loss against tokens accepted."""
    title = "Loss against tokens"
    steps, held = _losses(run, by_time=False)
    if not steps and not held:
        return _no_losses("loss_vs_tokens.png", title)
    fig, (left, right) = new_figure(ncols=2, width_in=10.0)
    bad = draw_losses(left, _training_curves(steps, lambda s: s.tokens, ""), marker=None)
    left.set_xlabel("tokens trained by the cluster")
    tokens_axis(left.xaxis)
    tokens_axis(right.xaxis)
    left.set_ylabel("training loss (nats/token)")
    left.set_title("each cluster's training loss")
    if held:
        bad += draw_losses(right, _heldout_curve(held), marker=None)
    else:
        right.text(0.5, 0.5, "no held-out evaluation recorded", ha="center", va="center",
                   transform=right.transAxes)
    right.set_xlabel("tokens accepted into the global model")
    right.set_ylabel("held-out loss (nats/token)")
    right.set_title("global model")
    notes = [] if steps else ["no cluster training losses found (train.jsonl)"]
    return finish("loss_vs_tokens.png", title, fig, "; ".join(notes + _diverged_note(bad)) or None)


def plot_tokens_per_cluster(run: RunFiles) -> Plot:
    """Bars: tokens each cluster trained on, and tokens accepted from it (the leader's T_j),
    counted as ``summary.json``'s ``per_cluster`` counts them
    (:func:`dips.algo.pushcounts.push_counts`: a rolled-back step's tokens taken back)."""
    title = "Tokens per cluster"
    consumed: dict[str, float] = {}
    per = (run.summary or {}).get("tokens_consumed_per_cluster")
    if isinstance(per, dict):
        consumed = {str(k): float(v) for k, v in per.items() if isinstance(v, (int, float))}
    for cid, recs in run.clusters.items():
        if cid not in consumed and (n := tokens_consumed_of(recs)):
            consumed[cid] = float(n)
    accepted = {cid: float(row["tokens_accepted"])
                for cid, row in push_counts(run.outer_log).per_cluster.items()
                if row["updates_accepted"] or row["updates_lost"]}
    ids = sorted(set(consumed) | set(accepted))
    if not ids:
        return empty_plot("tokens_per_cluster.png", title,
                          "no token counts found (summary.json, train.jsonl, outer_steps.jsonl)")
    fig, (ax,) = new_figure(width_in=max(5.0, 1.2 * len(ids) + 3))
    xs = range(len(ids))
    if consumed:
        ax.bar([x - 0.2 for x in xs], [consumed.get(c, 0.0) for c in ids], width=0.4,
               label="trained on (all inner steps)")
    if accepted:
        ax.bar([x + 0.2 for x in xs], [accepted.get(c, 0.0) for c in ids], width=0.4,
               label="accepted into the global model")
    ax.set_xticks(list(xs), ids)
    ax.set_ylabel("tokens")
    top = max([*consumed.values(), *accepted.values(), 0.0])
    if top > 0:  # room above the tallest bar for the legend (review 26: it hid bar tops)
        ax.set_ylim(0, 1.3 * top)
    tokens_axis(ax.yaxis)
    ax.set_title(title)
    note = None if consumed and accepted else (
        "no accepted pushes in outer_steps.jsonl" if consumed else "no per-cluster training counts")
    return finish("tokens_per_cluster.png", title, fig, note)
