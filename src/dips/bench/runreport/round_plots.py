"""The round plots: timeline, staleness and penalty scores (``outer_steps.jsonl``, ``train.jsonl``).

* ``timeline.png``: one row per cluster with its inner steps, push, wait (for the verdict) and
  pull as horizontal bars, from the ``push`` field of its sync steps in ``train.jsonl`` (the
  step's ``time`` is when the pull ended; push, wait and pull lie before it, back to back, and
  the inner steps run from the previous sync's end or the join, and after a process's last
  sync until its last step), and its holds (``hold`` to ``hold_end`` records: it could not
  sync and trained nothing, :mod:`dips.algo.hold`) as ``held``; one row for the leader with
  each round's grace window, push phase and update, from ``outer_steps.jsonl`` (its line's
  ``time`` is when every follower had prepared: update before it, push phase and window before
  that).  Top: the whole run; bottom (when it is under half the run): a zoom on a stretch
  without faults or outages, at most a quarter of the run, of about :data:`ZOOM_ROUNDS`
  complete rounds of each cluster present, each from one sync's end to the next's (inner
  steps, push, wait, pull), its title saying what it holds (:mod:`dips.bench.runreport.zoom`;
  review 26 M4, review 28 #4).
* ``staleness.png``: how many versions behind the global model each push's base version was
  (the version before the round minus ``base_versions[c]``), per cluster;
* ``scores.png``: each scored push's penalty score E (§8) by decision (the n-th decision line:
  a restarted leader skips the round numbers it had reserved, review 26 M2, so round numbers
  would show empty stretches that look like outages) with the rejection threshold
  (``thresholds[c]`` per cluster, or an older file's single ``threshold``) and the leader's
  restarts (``leader_resumed``) as dotted lines, and their distribution, accepted and
  rejected apart.

The staleness and score plots take decision records, so they serve a comparison's Di-PS
``events.jsonl`` (same fields) as well.
"""

from __future__ import annotations

from statistics import median
from typing import Any, Sequence

from dips.bench.runreport.faults import fault_rows
from dips.bench.runreport.figs import Plot, empty_plot, finish, mark_at, new_figure, time_axis
from dips.bench.runreport.files import RunFiles, num
from dips.bench.runreport.zoom import ZOOM_ROUNDS, zoom_window

__all__ = ["ZOOM_ROUNDS", "plot_scores", "plot_staleness", "plot_timeline", "staleness_of",
           "sync_bars", "zoom_window"]

_KINDS = (("inner steps", "#9ecae1"), ("held", "#bdbdbd"), ("push", "#e6550d"),
          ("wait", "#fdd0a2"), ("pull", "#31a354"))
_LEADER = (("grace window", "#bcbddc"), ("push phase", "#e6550d"), ("update", "#756bb1"))


def sync_bars(run: RunFiles, records: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Bars (start s since the training start, width s) of one cluster, by kind (module doc)."""
    bars: dict[str, list[tuple[float, float]]] = {k: [] for k, _ in _KINDS}
    seg_start: float | None = None
    last_step: float | None = None
    hold_at: float | None = None  # a hold in progress (dips.algo.hold): nothing trained
    for rec in records:
        t = num(rec, "time")
        if t is None:
            continue
        t = run.rel(t)
        if rec.get("event") == "join":
            _close(bars, seg_start, hold_at if hold_at is not None else last_step)
            seg_start = last_step = t
            hold_at = None
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
            continue
        pull, wait, push_s = (num(push, k) or 0.0 for k in ("pull_s", "wait_s", "push_s"))
        pull_at = t - pull
        wait_at = pull_at - wait
        push_at = wait_at - push_s
        trained_to = push_at if hold_at is None else min(push_at, hold_at)
        bars["inner steps"].append((seg_start, max(0.0, trained_to - seg_start)))
        bars["push"].append((push_at, push_s))
        bars["wait"].append((wait_at, wait))
        bars["pull"].append((pull_at, pull))
        seg_start, hold_at = t, None
    _close(bars, seg_start, hold_at if hold_at is not None else last_step)
    return bars


def _close(bars: dict[str, list[tuple[float, float]]], start: float | None,
           end: float | None) -> None:
    """The inner steps after a process's last sync (until its last step), if any."""
    if start is not None and end is not None and end > start:
        bars["inner steps"].append((start, end - start))


def _leader_bars(run: RunFiles) -> dict[str, list[tuple[float, float]]]:
    bars: dict[str, list[tuple[float, float]]] = {k: [] for k, _ in _LEADER}
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


def plot_timeline(run: RunFiles) -> Plot:
    """Bars of each cluster's inner steps / push / wait / pull and the leader's rounds."""
    title = "Timeline of rounds"
    rows = {cid: sync_bars(run, recs) for cid, recs in sorted(run.clusters.items())}
    rows = {cid: b for cid, b in rows.items() if b["push"]}
    leader = _leader_bars(run)
    if not rows and not leader["update"]:
        return empty_plot("timeline.png", title,
                          "no sync steps in any train.jsonl and no rounds in outer_steps.jsonl")
    ends = [s + w for b in [*rows.values(), leader] for bs in b.values() for s, w in bs]
    span = max(ends + [1.0])
    zoom = zoom_window(leader, rows, span, [r.time_s for r in fault_rows(run)])
    lo, hi = zoom.lo, zoom.hi
    zoom_w = hi - lo
    panels = [(0.0, span)] + [(lo, hi)] * (zoom_w < span / 2)
    fig, axes = new_figure(nrows=len(panels), width_in=10.0,
                           height_in=(1.0 + 0.45 * (len(rows) + 1)) * len(panels) + 1.0)
    seen: set[str] = set()  # each kind labelled once, in the top panel (the whole run)
    for ax, (lo, hi) in zip(axes, panels):
        div, unit = time_axis(hi - lo)
        labels: list[str] = []
        for y, (name, b, kinds) in enumerate(
                [("leader", leader, _LEADER)] * bool(leader["update"])
                + [(cid, b, _KINDS) for cid, b in rows.items()]):
            labels.append(name)
            for kind, color in kinds:
                xs = [(s / div, w / div) for s, w in b[kind] if s + w >= lo and s <= hi]
                if xs:
                    ax.broken_barh(xs, (y - 0.35, 0.7), color=color,
                                   label="_" if kind in seen else kind)
                    seen.add(kind)
        ax.set_yticks(range(len(labels)), labels)
        ax.set_ylim(len(labels) - 0.5, -0.5)
        ax.set_xlim(lo / div, hi / div)
        ax.set_xlabel(f"wall time since the training start ({unit})")
    axes[0].set_title("whole run")
    for ax in axes[1:]:
        ax.set_title(zoom.title(), fontsize=9)
    plot = finish("timeline.png", title, fig, None if rows else
                  "no cluster train.jsonl with sync steps: only the leader's rounds")
    for ax, keep in zip(axes, (True, False)):  # one legend, beside the plot: bars fill the axes
        if ax.get_legend() is not None:
            ax.get_legend().remove()
        if keep and ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return plot


def staleness_of(records: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Per cluster, the versions between each push's base and the version the round started from."""
    out: dict[str, list[int]] = {}
    for rec in records:
        version, bases = num(rec, "version"), rec.get("base_versions")
        if version is None or not isinstance(bases, dict):
            continue
        before = version - 1 if rec.get("accepted") else version
        for cid in bases:
            if (b := num(bases, cid)) is not None:
                out.setdefault(str(cid), []).append(int(before - b))
    return out


def plot_staleness(records: list[dict[str, Any]], name: str = "staleness.png") -> Plot:
    """Histogram (versions behind) of every push's staleness, one bar set per cluster."""
    title = "Staleness of pushes"
    st = staleness_of(records)
    if not st:
        return empty_plot(name, title, "no base_versions in outer_steps.jsonl")
    top = max(max(v) for v in st.values())
    bins = list(range(min(0, min(min(v) for v in st.values())), top + 1))
    fig, (ax,) = new_figure(width_in=max(6.0, 0.5 * len(bins) + 4))
    width = 0.8 / len(st)
    for i, (cid, vals) in enumerate(sorted(st.items())):
        ax.bar([b - 0.4 + width * (i + 0.5) for b in bins], [vals.count(b) for b in bins],
               width=width, label=f"{cid} (mean {sum(vals) / len(vals):.2f})")
    ax.set_xticks(bins)
    ax.set_xlabel("staleness (versions behind the global model at the round)")
    ax.set_ylabel("pushes")
    ax.set_title(title)
    return finish(name, title, fig)


def _thresholds(rec: dict[str, Any], cids: list[str]) -> dict[str, float]:
    per = rec.get("thresholds")
    if isinstance(per, dict):
        return {c: v for c in cids if (v := num(per, c)) is not None}
    single = num(rec, "threshold")
    return {} if single is None else {c: single for c in cids}


def plot_scores(records: list[dict[str, Any]], name: str = "scores.png",
                restarts: Sequence[float] = ()) -> Plot:
    """Score E by decision per cluster with the threshold and the leader's ``restarts``
    (epoch s, drawn before the first decision after each); distribution of accepted/rejected
    E (module doc)."""
    title = "Penalty scores and the rejection threshold"
    pts: list[tuple[float, str, float, bool, float | None]] = []  # decision, cluster, E, ok, thr
    unscored = 0
    decisions = [rec for rec in records if num(rec, "round") is not None]
    times = [num(rec, "time") for rec in decisions]
    for k, rec in enumerate(decisions):
        rnd, scores = k, rec.get("scores")
        if not isinstance(scores, dict):
            continue
        thr = _thresholds(rec, list(scores))
        accepted = set(rec.get("accepted") or [])
        for cid in scores:
            if (e := num(scores, cid)) is None:
                unscored += 1
                continue
            pts.append((rnd, str(cid), e, cid in accepted, thr.get(cid)))
    if not pts:
        return empty_plot(name, title, "no scored pushes (outer_steps.jsonl scores)")
    fig, (left, right) = new_figure(ncols=2, width_in=11.0)
    for cid in sorted({p[1] for p in pts}):
        mine = [p for p in pts if p[1] == cid]
        left.plot([p[0] for p in mine], [p[2] for p in mine], "o", markersize=3, label=cid)
    rej = [p for p in pts if not p[3]]
    if rej:
        left.plot([p[0] for p in rej], [p[2] for p in rej], "x", color="red", markersize=7,
                  label="rejected")
    thr = [(p[0], p[4]) for p in pts if p[4] is not None]
    if thr:
        left.plot([t[0] for t in thr], [t[1] for t in thr], "_", color="black", markersize=9,
                  label="threshold")
    mark_at(left, [sum(1 for t in times if t is not None and t < r) - 0.5 for r in restarts
                   if any(t is not None and t > r for t in times)], "leader restart")
    left.set_xlabel("decision (n-th outer-step decision of the run)")
    left.set_ylabel("score E (σ above the others' mean ‖Δ‖²)")
    left.set_title("scores by decision")
    if rej:
        right.hist([[p[2] for p in pts if p[3]], [p[2] for p in rej]], bins=20, stacked=True,
                   color=["C0", "red"], label=["accepted", "rejected"])
    else:
        right.hist([p[2] for p in pts], bins=20, color="C0", label="accepted")
    if thr:
        right.axvline(median(t[1] for t in thr), color="black", linestyle="--",
                      label="threshold (median)")
    right.set_xlabel("score E")
    right.set_ylabel("pushes")
    right.set_title("distribution")
    note = (f"{unscored} push(es) without a score (warm-up, or rejected before scoring)"
            if unscored else None)
    return finish(name, title, fig, note)
