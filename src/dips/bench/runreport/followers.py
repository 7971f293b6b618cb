"""``followers.png``: each follower's utilisation and its outages over the whole run.

Utilisation: the % of wall time a follower was busy updating (the leader's score, aggregate,
apply and commit calls), receiving pushes and serving pulls, stacked, from its
``applied.jsonl`` records' ``busy_s`` and ``span_s`` (:class:`dips.wire.workers.BusyTime`);
for older files their ``idle_fraction`` or ``utilisation``, else the version each applied
over time. A follower writes a record per outer step it applies, so its records end where
the run stopped making steps: the busy share is of the time its records cover, and the title
says which.

The x-axis spans the whole run (:func:`dips.bench.runreport.span.run_span`: to the last
record of any member), the stop is marked, and each follower's down stretches
(:func:`dips.bench.runreport.span.down_stretches`: its process gone, or the leader had it
down) are shaded, open ones (no record ends them) hatched (review 33 M2: the figure covered
0-8 s of a 75 s run and none of the three follower outages).
"""

from __future__ import annotations

from typing import Any

from matplotlib.axes import Axes

from dips.algo.faultlog import follower_member
from dips.bench.runreport.figs import (
    DOWN_COLOUR,
    Plot,
    empty_plot,
    finish,
    mark_stop,
    new_figure,
    time_axis,
)
from dips.bench.runreport.files import RunFiles, num
from dips.bench.runreport.span import RunSpan, Stretch, down_stretches, run_span

__all__ = ["PHASES", "busy_spans", "plot_followers"]

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


def _shade_down(ax: Axes, stretches: list[Stretch], div: float) -> None:
    """The follower's down stretches on ``ax``, each kind labelled once per axes."""
    for k, s in enumerate(stretches):
        label = "down, open: no record ends it" if s.open else "down"
        first = all(o.open != s.open for o in stretches[:k])
        ax.axvspan(s.start / div, s.end / div, facecolor=DOWN_COLOUR, alpha=0.25,
                   hatch="///" if s.open else None, edgecolor=DOWN_COLOUR, linewidth=0.0,
                   label=label if first else "_")


def _down_words(stretches: list[Stretch]) -> str:
    if not stretches:
        return ""
    parts = [f"{s.start:,.0f}-{s.end:,.0f} s{' (open)' if s.open else ''}" for s in stretches[:4]]
    more = f" and {len(stretches) - 4} more" if len(stretches) > 4 else ""
    return f"; down {', '.join(parts)}{more}"


def _plot_busy(run: RunFiles, span: RunSpan, down: dict[str, list[Stretch]]) -> Plot:
    """One axes per follower: the % of wall time it was busy in each phase, stacked."""
    spans = {fid: busy_spans(run, recs) for fid, recs in sorted(run.followers.items())}
    spans = {fid: sp for fid, sp in spans.items() if sp}
    div, unit = time_axis(span.end)
    fig, axes = new_figure(nrows=len(spans), height_in=1.4 + 1.9 * len(spans))
    tops: list[float] = []
    ends: list[str] = []
    for ax, (fid, sp) in zip(axes, spans.items()):
        bottom = [0.0] * len(sp)
        for (phase, label), color in zip(PHASES, ("C0", "C1", "C2")):
            ys = [pct[phase] for _, _, pct in sp]
            ax.bar([s / div for s, _, _ in sp], ys, width=[(e - s) / div for s, e, _ in sp],
                   bottom=bottom, align="edge", color=color, label=label, linewidth=0)
            bottom = [b + y for b, y in zip(bottom, ys)]
        tops.append(max(bottom))
        mine = down.get(follower_member(fid), [])
        _shade_down(ax, mine, div)
        mark_stop(ax, span.stop, span.stop_reason, div, end_s=span.end)
        ax.set_xlim(0, span.end / div)
        ax.set_ylabel(f"follower {fid}\n% of wall time")
        covered = sum(e - s for s, e, _ in sp)
        mean = sum(sum(p.values()) * (e - s) for s, e, p in sp) / max(1e-9, covered)
        last = sp[-1][1]
        ax.set_title(f"follower {fid}: busy {mean:.1f}% of the {covered:,.1f} s its records "
                     f"cover (to {last:,.1f} s){_down_words(mine)}", fontsize=9)
        if last < 0.9 * (span.stop if span.stop is not None else span.end):
            ends.append(f"{last:,.1f} s (follower {fid})")
    for ax in axes:  # one scale for all, from the busiest, with room for the legend above
        ax.set_ylim(0, max(5.0, 1.6 * max(tops)))
    axes[-1].set_xlabel(f"wall time since the training start ({unit})")
    fig.suptitle("Follower utilisation: busy time by phase, and outages")
    missing = sorted(set(run.followers) - set(spans))
    notes = [f"no busy time recorded by follower {', '.join(missing)} (an older version)"
             ] if missing else []
    if ends:
        notes.append(f"applied.jsonl records end at {', '.join(ends)}, before the run did: a "
                     "follower records its busy time with each outer step it applies, and "
                     "none was applied after that")
    plot = finish("followers.png", "Followers", fig, "; ".join(notes) or None)
    phases = [label for _, label in PHASES]
    for ax in axes:  # above the bars, never over them: the phases first, then the outages
        handles, labels = ax.get_legend_handles_labels()
        order = sorted(range(len(labels)), key=lambda i: labels[i] not in phases)
        ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=7,
                  loc="upper center", ncols=3, facecolor="white", edgecolor="none",
                  framealpha=0.9)
    return plot


def _utilisation(rec: dict[str, Any]) -> float | None:
    if (u := num(rec, "utilisation")) is not None:
        return 100.0 * u
    if (idle := num(rec, "idle_fraction")) is not None:
        return 100.0 * (1.0 - idle)
    return None


def plot_followers(run: RunFiles) -> Plot:
    """Each follower's utilisation over the whole run with its outages (module doc): its busy
    time by phase (``busy_s`` and ``span_s`` of its ``applied.jsonl`` records) stacked as %
    of wall time, one axes per follower; from an older version's
    ``idle_fraction``/``utilisation``; else the version it applied."""
    title = "Followers"
    if not run.followers:
        return empty_plot("followers.png", title, "no follower applied.jsonl found")
    span = run_span(run)
    down = down_stretches(run, span)
    if any(busy_spans(run, recs) for recs in run.followers.values()):
        return _plot_busy(run, span, down)
    util = any(_utilisation(r) is not None for recs in run.followers.values() for r in recs)
    fig, (ax,) = new_figure()
    div, unit = time_axis(span.end)
    for i, (fid, recs) in enumerate(sorted(run.followers.items())):
        pts = [(run.rel(t), _utilisation(r) if util else num(r, "version"))
               for r in recs if (t := num(r, "time")) is not None]
        pts = [(t / div, y) for t, y in pts if y is not None]
        if pts:
            ax.step([t for t, _ in pts], [y for _, y in pts], where="post", label=f"follower {fid}",
                    linestyle=("-", "--", ":", "-.")[i % 4], linewidth=2.0 - 0.3 * (i % 4))
    _shade_down(ax, [s for fid in sorted(run.followers)
                     for s in down.get(follower_member(fid), [])], div)
    mark_stop(ax, span.stop, span.stop_reason, div, end_s=span.end)
    ax.set_xlim(0, span.end / div)
    ax.set_xlabel(f"wall time since the training start ({unit})")
    ax.set_ylabel("utilisation (% busy)" if util else "version applied")
    ax.set_title("Follower utilisation" if util else "Version applied by each follower")
    note = None if util else ("the followers' files carry no utilisation (applied.jsonl: version, "
                              "round, time); shown instead: the version each one applied")
    return finish("followers.png", title, fig, note)
