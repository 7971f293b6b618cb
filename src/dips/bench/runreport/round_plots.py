"""The decision plots: staleness and penalty scores (``outer_steps.jsonl``); the timeline of
rounds is :mod:`dips.bench.runreport.timeline`.

* ``staleness.png``: how many versions behind the global model each push's base version was
  (the version before the round minus ``base_versions[c]``), per cluster;
* ``scores.png``: each scored push's penalty score E (§8) by decision (the n-th decision line,
  counted from 1 as the axis says, review 33 m4; not by round number: a restarted leader
  skips the round numbers it had reserved, review 26 M2, so round numbers would show empty
  stretches that look like outages) with the rejection threshold
  (``thresholds[c]`` per cluster, or an older file's single ``threshold``) and the leader's
  restarts (``leader_resumed``) as dotted lines, and their distribution, accepted and
  rejected apart.

The staleness and score plots take decision records, so they serve a comparison's Di-PS
``events.jsonl`` (same fields) as well.
"""

from __future__ import annotations

from statistics import median
from typing import Any, Sequence

from dips.bench.runreport.figs import Plot, empty_plot, finish, mark_at, new_figure
from dips.bench.runreport.files import num

__all__ = ["plot_scores", "plot_staleness", "staleness_of"]


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
    for k, rec in enumerate(decisions, start=1):
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
    mark_at(left, [sum(1 for t in times if t is not None and t < r) + 0.5 for r in restarts
                   if any(t is not None and t > r for t in times)], "leader restart")
    left.set_xlabel("decision (n-th outer-step decision of the run, from 1)")
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
