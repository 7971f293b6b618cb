"""The loss, token and follower plots of one run (``dips report`` on a run directory).

* ``loss_vs_time.png``: each cluster's training loss (nats/token, a trailing mean over its
  inner steps) and the global model's held-out loss against seconds since the training start;
* ``loss_vs_tokens.png``: left, each cluster's training loss against the tokens it trained on
  (across restarts of its process); right, the held-out loss against tokens accepted into the
  global model; a cluster's line breaks between two of its processes (:meth:`ClusterSteps.
  lines`);
* ``tokens_per_cluster.png``: tokens each cluster trained on and tokens accepted from it;
* ``followers.png``: each follower's utilisation: the % of wall time it was busy updating
  (the leader's score, aggregate, apply and commit calls), receiving pushes and serving
  pulls, stacked, from its ``applied.jsonl`` records' ``busy_s`` and ``span_s``
  (:class:`dips.wire.workers.BusyTime`); for older files their ``idle_fraction`` or
  ``utilisation``, else the version each applied over time.

Held-out points: ``eval_loss_initial`` (at 0 s, 0 tokens), every evaluation record (the
leader's ``eval.jsonl`` of ``dips evaluate``: at its ``time`` and ``tokens_accepted``), and
``eval_loss_final`` (at ``train_time_s``, ``tokens_accepted``) of ``summary.json`` (without
the ``train_start`` file to count ``train_time_s`` from: at the last outer step); the
summary's points are left out where the series has their version (0, ``final_version``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from dips.algo.consumed import consumed_series, tokens_consumed_of
from dips.bench.runreport.figs import (
    LossCurve,
    Plot,
    draw_losses,
    empty_plot,
    finish,
    new_figure,
    smooth,
    time_axis,
    tokens_axis,
)
from dips.bench.runreport.files import RunFiles, num

__all__ = ["ClusterSteps", "busy_spans", "cluster_steps", "heldout_points", "plot_followers",
           "plot_loss_vs_time",
           "plot_loss_vs_tokens", "plot_tokens_per_cluster"]


@dataclass
class ClusterSteps:
    """One cluster's inner steps: seconds since the start, cumulative tokens (across process
    restarts: a count that falls back starts a new lifetime on top of the last), loss; and
    ``lifetimes``, the index of each process's first step (a ``join`` record starts one)."""

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
    out = ClusterSteps([], [], [], [0])
    process = 0
    for st in consumed_series(records):
        rec = records[st.index]
        loss, t = num(rec, "loss"), num(rec, "time")
        if loss is None or t is None:
            continue
        if st.process != process and out.lifetimes[-1] < len(out.loss):
            out.lifetimes.append(len(out.loss))  # a new process of this cluster
        process = st.process
        out.time_s.append(run.rel(t))
        out.tokens.append(float(st.tokens))
        out.loss.append(loss)
    return out


def heldout_points(run: RunFiles) -> list[tuple[float | None, float | None, float]]:
    """(seconds since the start, tokens accepted, held-out loss) of every evaluation known:
    the initial model's (``summary.json``'s ``eval_loss_initial``, else ``run.json``'s, as
    the key figures take it), the evaluations, the summary's final one (the initial or final
    point is left out when an evaluation record is of the same version: the evaluator's
    series already has it)."""
    s = run.summary or {}
    pts: list[tuple[float | None, float | None, float]] = []
    versions = {r.get("version") for r in run.evals}
    initial = num(s, "eval_loss_initial")
    if initial is None:  # a run in progress, or without the launcher's files (review 28 #5)
        initial = num(run.run_spec or {}, "eval_loss_initial")
    if initial is not None and 0 not in versions:
        pts.append((0.0, 0.0, initial))
    for rec in run.evals:
        t = num(rec, "time")
        tok = num(rec, "tokens_accepted")
        pts.append((None if t is None else run.rel(t),
                    tok if tok is not None else num(rec, "tokens"), float(rec["eval_loss"])))
    final = s.get("final_version")
    if (v := num(s, "eval_loss_final")) is not None and (final is None or final not in versions):
        ends = [run.rel(t) for r in run.outer_steps if (t := num(r, "time")) is not None]
        t_end = num(s, "train_time_s") if run.train_start is not None or not ends else max(ends)
        pts.append((t_end, num(s, "tokens_accepted"), v))
    return pts


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
    span = max([t for s in steps.values() for t in s.time_s] + [t for t, _ in held] + [1.0])
    div, unit = time_axis(span)
    fig, (ax,) = new_figure()
    bad = draw_losses(ax, [*_training_curves(steps, lambda s: [t / div for t in s.time_s],
                                             " training loss"),
                           *_heldout_curve([(t / div, v) for t, v in held])], marker=None)
    ax.set_xlabel(f"wall time since the training start ({unit})")
    ax.set_ylabel("loss (nats/token)")
    notes = [] if held else ["no held-out evaluation in the run (summary.json eval_loss_*)"]
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
    """Bars: tokens each cluster trained on, and tokens accepted from it (the leader's T_j)."""
    title = "Tokens per cluster"
    consumed: dict[str, float] = {}
    per = (run.summary or {}).get("tokens_consumed_per_cluster")
    if isinstance(per, dict):
        consumed = {str(k): float(v) for k, v in per.items() if isinstance(v, (int, float))}
    for cid, recs in run.clusters.items():
        if cid not in consumed and (n := tokens_consumed_of(recs)):
            consumed[cid] = float(n)
    accepted: dict[str, float] = {}
    for rec in run.outer_steps:
        toks = rec.get("tokens") if isinstance(rec.get("tokens"), dict) else {}
        for cid in rec.get("accepted") or []:
            if (t := num(toks, cid)) is not None:
                accepted[cid] = accepted.get(cid, 0.0) + t
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


#: Busy phases of a follower's ``applied.jsonl`` records (:class:`dips.wire.workers.BusyTime`)
PHASES = (("update", "update (score, aggregate, apply, commit)"),
          ("push", "receiving pushes"), ("pull", "serving pulls"))
_BARS = 150  # bars per follower at most: records are summed into as many time spans


def busy_spans(run: RunFiles, recs: list[dict[str, Any]]) -> list[tuple[float, float,
                                                                         dict[str, float]]]:
    """A follower's utilisation: ``(start s, end s, {phase: % of the span busy})`` over the
    records that carry ``busy_s`` and ``span_s`` (each covers the ``span_s`` seconds before
    its ``time``), consecutive records summed into at most :data:`_BARS` spans."""
    pts = [(run.rel(t), span, rec["busy_s"]) for rec in recs
           if (t := num(rec, "time")) is not None and (span := num(rec, "span_s")) is not None
           and span > 0 and isinstance(rec.get("busy_s"), dict)]
    k = max(1, -(-len(pts) // _BARS))
    out = []
    for i in range(0, len(pts), k):
        group = pts[i:i + k]
        span = sum(g[1] for g in group)
        busy = {p: sum(num(g[2], p) or 0.0 for g in group) for p, _ in PHASES}
        out.append((max(0.0, group[0][0] - group[0][1]), group[-1][0],
                    {p: 100.0 * b / span for p, b in busy.items()}))
    return out


def _plot_busy(run: RunFiles) -> Plot:
    """One axes per follower: the % of wall time it was busy in each phase, stacked."""
    spans = {fid: busy_spans(run, recs) for fid, recs in sorted(run.followers.items())}
    spans = {fid: sp for fid, sp in spans.items() if sp}
    end = max(e for sp in spans.values() for _, e, _ in sp)
    div, unit = time_axis(max(end, 1.0))
    fig, axes = new_figure(nrows=len(spans), height_in=1.2 + 1.8 * len(spans))
    tops: list[float] = []
    for ax, (fid, sp) in zip(axes, spans.items()):
        bottom = [0.0] * len(sp)
        for (phase, label), color in zip(PHASES, ("C0", "C1", "C2")):
            ys = [pct[phase] for _, _, pct in sp]
            ax.bar([s / div for s, _, _ in sp], ys, width=[(e - s) / div for s, e, _ in sp],
                   bottom=bottom, align="edge", color=color, label=label, linewidth=0)
            bottom = [b + y for b, y in zip(bottom, ys)]
        tops.append(max(bottom))
        ax.set_xlim(0, end / div)
        ax.set_ylabel(f"follower {fid}\n% of wall time")
        mean = sum(sum(p.values()) * (e - s) for s, e, p in sp) / max(
            1e-9, sum(e - s for s, e, _ in sp))
        ax.set_title(f"follower {fid}: busy {mean:.1f}% of the time, idle the rest", fontsize=9)
    for ax in axes:  # one scale for all, from the busiest, with room for the legend above
        ax.set_ylim(0, max(5.0, 1.35 * max(tops)))
    axes[-1].set_xlabel(f"wall time since the training start ({unit})")
    fig.suptitle("Follower utilisation: busy time by phase")
    missing = sorted(set(run.followers) - set(spans))
    plot = finish("followers.png", "Followers", fig,
                  f"no busy time recorded by follower {', '.join(missing)} (an older version)"
                  if missing else None)
    for ax in axes:  # one row above the bars, never over them
        ax.legend(fontsize=7, loc="upper center", ncols=3, frameon=False)
    return plot


def _utilisation(rec: dict[str, Any]) -> float | None:
    if (u := num(rec, "utilisation")) is not None:
        return 100.0 * u
    if (idle := num(rec, "idle_fraction")) is not None:
        return 100.0 * (1.0 - idle)
    return None


def plot_followers(run: RunFiles) -> Plot:
    """Each follower's utilisation over time: its busy time by phase (``busy_s`` and
    ``span_s`` of its ``applied.jsonl`` records) stacked as % of wall time, one axes per
    follower; from an older version's ``idle_fraction``/``utilisation``; else the version
    it applied."""
    title = "Followers"
    if not run.followers:
        return empty_plot("followers.png", title, "no follower applied.jsonl found")
    if any(busy_spans(run, recs) for recs in run.followers.values()):
        return _plot_busy(run)
    util = any(_utilisation(r) is not None for recs in run.followers.values() for r in recs)
    fig, (ax,) = new_figure()
    span = max([run.rel(t) for recs in run.followers.values() for r in recs
                if (t := num(r, "time")) is not None] + [1.0])
    div, unit = time_axis(span)
    for i, (fid, recs) in enumerate(sorted(run.followers.items())):
        pts = [(run.rel(t), _utilisation(r) if util else num(r, "version"))
               for r in recs if (t := num(r, "time")) is not None]
        pts = [(t / div, y) for t, y in pts if y is not None]
        if pts:
            ax.step([t for t, _ in pts], [y for _, y in pts], where="post", label=f"follower {fid}",
                    linestyle=("-", "--", ":", "-.")[i % 4], linewidth=2.0 - 0.3 * (i % 4))
    ax.set_xlabel(f"wall time since the training start ({unit})")
    ax.set_ylabel("utilisation (% busy)" if util else "version applied")
    ax.set_title("Follower utilisation" if util else "Version applied by each follower")
    note = None if util else ("the followers' files carry no utilisation (applied.jsonl: version, "
                              "round, time); shown instead: the version each one applied")
    return finish("followers.png", title, fig, note)
