"""``timeline.png``: the rounds of every member as bars, over the whole run and in a zoom.

* One row per **cluster** with its inner steps, push, wait (for the verdict) and pull, from
  the ``push`` field of its sync steps in ``train.jsonl`` (the step's ``time`` is when the
  pull ended; the sync began at the ``sync_start`` record before it: the push from there,
  the pull up to the line, the rest of the sync as wait, so a sync blocked on a leader that
  does not answer is never drawn as training (review 35 of issue 15, F1); without a
  ``sync_start``, push, wait and pull lie back to back before the line), the inner steps from
  the previous sync's end or the join, and after a process's last sync until its last step;
  a ``sync_start`` no line ends (the process ended in that sync) as **sync, no end
  recorded**, to its process's end or, open, to the end of the run, as a hold is;
  and its holds (``hold`` to ``hold_end``: it could not sync and trained nothing,
  :mod:`dips.algo.hold`) as ``held``. A hold no record ends is drawn to its process's end
  (:meth:`dips.bench.runreport.span.RunSpan.hold_end`): where the process exited, or, still
  holding at the shutdown or with no launcher record, to the end of the run, marked open
  (review 33 M2: a cluster alive and holding from 26 s of a 75 s run looked like the
  clusters whose processes were killed).
* One row for the **leader** with each round's grace window, push phase and update, from
  ``outer_steps.jsonl`` (its line's ``time`` is when every follower had prepared: update
  before it, push phase and window before that).
* One row per **follower** that was ever down (followers leave no bars otherwise; in the
  zoom only where it was down there).
* On every row, **down**: the stretches the member had no process, a cluster was removed
  by the leader (until it joined again, in a new process or the same one: its ``join``
  record) or, for a follower, the leader had it down
  (:func:`dips.bench.runreport.span.down_stretches`), open ones drawn to the end of the run
  and marked open (faded and hatched, as an open hold is); a cluster's inner steps and holds
  are not drawn there (a process stopped, removed and back wrote no record meanwhile: its
  bar would span the removal).

Top: the whole run, from the training start to its end (the last record of any member,
:func:`dips.bench.runreport.span.run_span`), the stop marked; bottom (when it is under half
the run): a zoom on a stretch without faults or outages (:mod:`dips.bench.runreport.zoom`).
Each legend entry has a colour of its own (review 33 m7: the leader's push phase and a
cluster's push shared one).
"""

from __future__ import annotations

from typing import Any

from dips.algo.faultlog import cluster_member, follower_member
from dips.bench.runreport.faults import fault_rows
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
from dips.bench.runreport.span import LEADER, RunSpan, Stretch, down_stretches, run_span
from dips.bench.runreport.zoom import DOWN, OPEN, zoom_window

__all__ = ["CLUSTER_KINDS", "LEADER_KINDS", "UNFINISHED", "plot_timeline", "sync_bars"]

Bars = dict[str, list[tuple[float, float]]]  # kind -> [(start s, width s)]

#: A sync begun (its ``sync_start``) that no record ends: the process ended in it.
UNFINISHED = "sync, no end recorded"
CLUSTER_KINDS = (("inner steps", "#9ecae1"), ("held", "#bdbdbd"), ("push", "#e6550d"),
                 ("wait", "#fdd0a2"), ("pull", "#31a354"), (UNFINISHED, "#fd8d3c"))
LEADER_KINDS = (("grace window", "#bcbddc"), ("push phase", "#8c564b"), ("update", "#756bb1"))
#: Every row's down stretches (:data:`DOWN`).
DOWN_KIND = (DOWN, DOWN_COLOUR)
_LABELS = {DOWN: "down (no process, removed, or follower_down)", OPEN: "open: no record ends it"}
_ORDER = {_LABELS.get(k, k): i for i, k in enumerate(
    [k for k, _ in (*LEADER_KINDS, *CLUSTER_KINDS, DOWN_KIND)] + [OPEN])}
#: How an open bar is drawn over its colour: faded and hatched.
_OPEN_STYLE = {"facecolor": (1.0, 1.0, 1.0, 0.45), "edgecolor": "black", "hatch": "///",
               "linewidth": 0.0}


def _empty(kinds: tuple[tuple[str, str], ...]) -> Bars:
    return {k: [] for k, _ in (*kinds, DOWN_KIND)} | {OPEN: []}


def sync_bars(run: RunFiles, records: list[dict[str, Any]], cid: str | None = None,
              span: RunSpan | None = None) -> Bars:
    """Bars (start s since the training start, width s) of cluster ``cid`` (its launcher
    process's ends close an open hold or sync; None: not known), by kind (module doc);
    ``OPEN`` repeats the bars no record ends. ``span``: the run's (default :func:`run_span`)."""
    span = span or run_span(run)
    process = cluster_member(cid) if cid is not None else ""
    bars = _empty(CLUSTER_KINDS)
    seg_start: float | None = None
    last_step: float | None = None
    hold_at: float | None = None  # a hold in progress (dips.algo.hold): nothing trained
    sync_at: float | None = None  # a sync begun (``sync_start``) that no step's line ended yet
    for rec in records:
        t = num(rec, "time")
        if t is None:
            continue
        t = run.rel(t)
        if rec.get("event") == "join":
            if hold_at is not None:  # ended by its process's exit, or by this re-join
                end = min(span.hold_end(process, hold_at)[0], t)
                bars["held"].append((hold_at, end - hold_at))
            _close(bars, seg_start, _trained_to(sync_at, hold_at, last_step))
            if sync_at is not None:  # the process ended in it: killed, or its records lost
                _unfinished(bars, span, process, sync_at, until=t)
            seg_start = last_step = t
            hold_at = sync_at = None
            continue
        if rec.get("event") == "sync_start":
            sync_at = t
            continue
        if rec.get("event") == "hold":
            hold_at = t
            continue
        if rec.get("event") == "hold_end" and hold_at is not None:
            bars["held"].append((hold_at, max(0.0, t - hold_at)))
            if not isinstance(rec.get("push"), dict):  # ended without a sync (a re-join)
                _close(bars, seg_start, hold_at)
                seg_start, hold_at = t, None
                continue
        if num(rec, "step") is not None:
            last_step = t
        if seg_start is None and num(rec, "step") is not None:
            seg_start = t - (num(rec, "compute_s") or 0.0)
        push = rec.get("push")
        if not isinstance(push, dict) or seg_start is None:
            if num(rec, "step") is not None:
                sync_at = None  # the sync due was deferred (a backoff): the step trained on
            continue
        pull, wait, push_s = (num(push, k) or 0.0 for k in ("pull_s", "wait_s", "push_s"))
        if sync_at is not None and seg_start <= sync_at <= t:
            # The sync lasted from its sync_start to this line: its push first, its pull
            # last, the rest waiting (for the verdict, or a leader that does not answer).
            push_at = sync_at
            push_s = min(push_s, t - push_at)
            pull = min(pull, t - push_at - push_s)
            wait_at, pull_at = push_at + push_s, t - pull
            wait = pull_at - wait_at
        else:  # no sync_start (an older run, a hold's sync): back to back before the line
            pull_at = t - pull
            wait_at = pull_at - wait
            push_at = wait_at - push_s
        trained_to = push_at if hold_at is None else min(push_at, hold_at)
        bars["inner steps"].append((seg_start, max(0.0, trained_to - seg_start)))
        bars["push"].append((push_at, push_s))
        bars["wait"].append((wait_at, wait))
        bars["pull"].append((pull_at, pull))
        seg_start, hold_at, sync_at = t, None, None
    _close(bars, seg_start, _trained_to(sync_at, hold_at, last_step))
    if sync_at is not None:  # the process's last record: a sync nothing ended
        _unfinished(bars, span, process, sync_at)
    if hold_at is not None:  # the process's last record: a hold nothing ended
        end, is_open = span.hold_end(process, hold_at)
        bars["held"].append((hold_at, max(0.0, end - hold_at)))
        if is_open:
            bars[OPEN].append(bars["held"][-1])
    return bars


def _trained_to(sync_at: float | None, hold_at: float | None,
                last_step: float | None) -> float | None:
    """Where a process's inner steps after its last ended sync stop: at a sync or hold in
    progress, else at its last step."""
    return sync_at if sync_at is not None else hold_at if hold_at is not None else last_step


def _unfinished(bars: Bars, span: RunSpan, process: str, since: float,
                until: float | None = None) -> None:
    """A sync begun at ``since`` that no record ends: to its process's end (the next
    ``join`` at ``until`` at the latest), or open to the run's end (:meth:`RunSpan.hold_end`)."""
    end, is_open = span.hold_end(process, since)
    if until is not None and until < end:
        end, is_open = until, False
    bars[UNFINISHED].append((since, max(0.0, end - since)))
    if is_open:
        bars[OPEN].append(bars[UNFINISHED][-1])


def _close(bars: Bars, start: float | None, end: float | None) -> None:
    """The inner steps after a process's last sync (until its last step), if any."""
    if start is not None and end is not None and end > start:
        bars["inner steps"].append((start, end - start))


def _leader_bars(run: RunFiles) -> Bars:
    bars = _empty(LEADER_KINDS)
    for rec in run.outer_steps:
        t = num(rec, "time")
        if t is None:
            continue
        end = run.rel(t)
        upd, push, win = (num(rec, k) or 0.0 for k in ("update_s", "push_s", "window_s"))
        bars["update"].append((end - upd, upd))
        bars["push phase"].append((end - upd - push, push))
        bars["grace window"].append((end - upd - push - win, win))
    return bars


def _outside(bars: Bars, stretches: list[Stretch]) -> Bars:
    """``bars`` with their inner steps, holds and unfinished syncs cut where the member was down: a cluster
    stopped (SIGSTOP), removed and re-joined wrote no record meanwhile, so the bar from its
    last sync to its next one spans its removal (review 33 of issue 15, run2's cluster b)."""
    for kind in ("inner steps", "held", UNFINISHED, OPEN):
        cut = []
        for start, width in bars.get(kind, []):
            pieces = [(start, start + width)]
            for s in stretches:
                pieces = [p for lo, hi in pieces
                          for p in ((lo, min(hi, s.start)), (max(lo, s.end), hi)) if p[1] > p[0]]
            cut += [(lo, hi - lo) for lo, hi in pieces]
        if kind in bars:
            bars[kind] = cut
    return bars


def _add_down(bars: Bars, stretches: list[Stretch]) -> Bars:
    for s in stretches:
        bars[DOWN].append((s.start, s.width))
        if s.open:
            bars[OPEN].append((s.start, s.width))
    return bars


def _rows(run: RunFiles, span: RunSpan) -> list[tuple[str, Bars, tuple[tuple[str, str], ...]]]:
    """(label, bars, kinds) of every row with something to draw: leader, clusters, followers."""
    down = down_stretches(run, span)
    leader = _add_down(_leader_bars(run), down.get(LEADER, []))
    rows = [("leader", leader, LEADER_KINDS)] if any(leader.values()) else []
    for cid, recs in sorted(run.clusters.items()):
        gone = down.get(cluster_member(cid), [])
        b = _add_down(_outside(sync_bars(run, recs, cid, span), gone), gone)
        if any(b.values()):
            rows.append((cid, b, CLUSTER_KINDS))
    followers = sorted({w for w in down if w.startswith(follower_member(""))},
                       key=lambda w: (len(w), w))
    rows += [(w, _add_down(_empty(()), down[w]), ()) for w in followers]
    return rows


def plot_timeline(run: RunFiles) -> Plot:
    """Bars of each member's rounds and outages, the whole run and a zoom (module doc)."""
    title = "Timeline of rounds"
    span = run_span(run)
    rows = _rows(run, span)
    clusters = {label: b for label, b, kinds in rows if kinds is CLUSTER_KINDS}
    leader = next((b for label, b, _ in rows if label == "leader"), _empty(LEADER_KINDS))
    if not clusters and not leader["update"]:
        return empty_plot("timeline.png", title,
                          "no sync steps in any train.jsonl and no rounds in outer_steps.jsonl")
    zoom = zoom_window(leader, clusters, span.end, [r.time_s for r in fault_rows(run)])
    panels = [(0.0, span.end)] + [(zoom.lo, zoom.hi)] * (zoom.hi - zoom.lo < span.end / 2)
    fig, axes = new_figure(nrows=len(panels), width_in=10.0,
                           height_in=(1.0 + 0.45 * len(rows)) * len(panels) + 1.0)
    seen: set[str] = set()  # each kind labelled once, in the top panel (the whole run)
    for ax, (lo, hi) in zip(axes, panels):
        div, unit = time_axis(hi - lo)
        shown = [r for r in rows if r[2] or any(s + w >= lo and s <= hi for s, w in r[1][DOWN])]
        for y, (name, b, kinds) in enumerate(shown):
            for kind, color in (*kinds, DOWN_KIND):
                xs = [(s / div, w / div) for s, w in b[kind] if s + w >= lo and s <= hi]
                if xs:
                    ax.broken_barh(xs, (y - 0.35, 0.7), color=color,
                                   label="_" if kind in seen else _LABELS.get(kind, kind))
                    seen.add(kind)
            xs = [(s / div, w / div) for s, w in b[OPEN] if s + w >= lo and s <= hi]
            if xs:
                ax.broken_barh(xs, (y - 0.35, 0.7), **_OPEN_STYLE,
                               label="_" if OPEN in seen else _LABELS[OPEN])
                seen.add(OPEN)
        mark_stop(ax, span.stop, span.stop_reason, div, lo, hi, label=ax is axes[0],
                  end_s=span.end)
        ax.set_yticks(range(len(shown)), [name for name, _, _ in shown])
        ax.set_ylim(len(shown) - 0.5, -0.5)
        ax.set_xlim(lo / div, hi / div)
        ax.set_xlabel(f"wall time since the training start ({unit})")
    axes[0].set_title(f"whole run: 0 to {span.end:,.1f} s, the last record of any member",
                      fontsize=10)
    for ax in axes[1:]:
        ax.set_title(zoom.title(), fontsize=9)
    plot = finish("timeline.png", title, fig, None if clusters else
                  "no cluster train.jsonl with sync steps: only the leader's rounds")
    for ax, keep in zip(axes, (True, False)):  # one legend, beside the plot: bars fill the axes
        if ax.get_legend() is not None:
            ax.get_legend().remove()
        handles, labels = ax.get_legend_handles_labels()
        if keep and labels:  # in a fixed order: leader, clusters, down, open, the stop
            order = sorted(range(len(labels)), key=lambda i: _ORDER.get(labels[i], len(_ORDER)))
            ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=7,
                      loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return plot
