"""PNG plots of ``dips simulate`` (matplotlib, Agg backend), over the first ``timeline_s`` s.

* ``timeline.png``: up to :data:`ROWS_MAX` clusters and followers, one row per cluster,
  coloured by state (compute, admit, push, verdict, pull, join, down), and one row per
  follower with its outer steps (CPU busy). Above that (one row each would be unreadable) one
  panel per group of clusters, each showing the share of its clusters in each state over
  time (a stacked area, exact time shares per time bin), and a last panel with the share of
  followers running an outer step. The groups are the cluster types, slowest first
  (step × slowdown), or, with more than :data:`GROUPS_MAX` types, that many bands of clusters
  sorted by their type's step time;
* ``followers.png``: per follower, idle / CPU-busy / NIC-busy fractions of the whole run, and
  the NIC rate (bits/s, in and out, of the busiest follower at each change) over the window
  against the NIC's rate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a display

import matplotlib.pyplot as plt  # noqa: E402

from dips.sim.engine import Simulation  # noqa: E402

__all__ = ["GROUPS_MAX", "ROWS_MAX", "groups", "occupancy", "plot_all"]

#: Most rows (clusters + followers) drawn one per row in timeline.png; above, aggregates.
ROWS_MAX = 64
#: Most panels of cluster groups in an aggregated timeline.png.
GROUPS_MAX = 8
#: Time bins of an aggregated timeline.png.
BINS = 720

COLORS = {"compute": "#4c9f70", "admit": "#f2c14e", "push": "#d95d39", "verdict": "#f78154",
          "pull": "#56b4e9", "join": "#7d5ba6", "down": "#333333"}


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def timeline(sim: Simulation, path: Path) -> str:
    """Per-cluster states and per-follower outer steps over the window (hours): one row
    each up to :data:`ROWS_MAX` rows, else :func:`timeline_groups`."""
    if len(sim.members) + len(sim.loads) > ROWS_MAX:
        return timeline_groups(sim, path)
    rows = list(sim.members.values())
    n = len(rows) + len(sim.loads)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.22 * n))
    for y, m in enumerate(rows):
        for state, a, b in m.timeline:
            if state in COLORS:
                ax.broken_barh([(a / 3600, (b - a) / 3600)], (y - 0.4, 0.8),
                               color=COLORS[state], linewidth=0)
    for k, load in enumerate(sim.loads):
        y = len(rows) + k
        ax.broken_barh([(a / 3600, (b - a) / 3600) for a, b in load.updates], (y - 0.4, 0.8),
                       color="#1f4e79", linewidth=0)
    ax.set_yticks(range(n), [m.cid for m in rows] + [f"f{ld.index}" for ld in sim.loads],
                  fontsize=7)
    ax.set_xlim(0, min(sim.sc.timeline_s, sim.end_s) / 3600)
    ax.set_xlabel("simulated hours")
    ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="#1f4e79"))
    ax.legend(handles, [*COLORS, "outer step"], ncol=8, fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, 1.12 + 0.6 / n))
    ax.set_title(f"{sim.sc.name}: clusters and followers", pad=22)
    return _save(fig, path)


def groups(sim: Simulation) -> list[tuple[str, list[Any]]]:
    """The panels of :func:`timeline_groups`: (label, members), the cluster types, slowest
    (step_s × slowdown) first; with more than :data:`GROUPS_MAX` types, that many bands of
    about equal size of the clusters in that order."""
    def speed(m: Any) -> tuple[float, str]:
        return (-m.cfg.step_s * m.cfg.slowdown, m.cid)

    ordered = sorted(sim.members.values(), key=speed)
    types: dict[str, list[Any]] = {}
    for m in ordered:
        types.setdefault(m.cfg.id, []).append(m)
    if len(types) <= GROUPS_MAX:
        return [(f"{t}: {len(ms)} cluster{'s' if len(ms) > 1 else ''}, step "
                 f"{ms[0].cfg.step_s * ms[0].cfg.slowdown:.3g} s", ms) for t, ms in types.items()]
    n, k = len(ordered), GROUPS_MAX
    bands = [ordered[i * n // k:(i + 1) * n // k] for i in range(k)]
    return [(f"{b[0].cid}…{b[-1].cid}: {len(b)} clusters, step "
             f"{b[-1].cfg.step_s * b[-1].cfg.slowdown:.3g}–{b[0].cfg.step_s * b[0].cfg.slowdown:.3g} s",
             b) for b in bands if b]


def occupancy(spans: list[tuple[float, float]], end_s: float, bins: int) -> Any:
    """Per bin of ``[0, end_s)`` cut into ``bins`` equal bins: the time the ``spans``
    ((start, end) seconds, possibly overlapping) cover in it, divided by the bin's length
    (so n spans covering a bin give n). Exact, not sampled; returns a float64 array."""
    import numpy as np

    out = np.zeros(bins + 1)
    if not spans or end_s <= 0:
        return out[:bins]
    ab = np.clip(np.asarray(spans, dtype=float) * (bins / end_s), 0, bins)
    a, b = ab[:, 0], ab[:, 1]
    keep = b > a
    a, b = a[keep], b[keep]
    i0, i1 = np.floor(a).astype(int), np.floor(b).astype(int)
    same = i0 == i1
    np.add.at(out, i0[same], b[same] - a[same])
    a, b, i0, i1 = a[~same], b[~same], i0[~same], i1[~same]
    np.add.at(out, i0, i0 + 1 - a)
    np.add.at(out, i1, b - i1)
    full = np.zeros(bins + 2)
    np.add.at(full, i0 + 1, 1.0)
    np.add.at(full, i1, -1.0)
    return out[:bins] + np.cumsum(full)[:bins]


def timeline_groups(sim: Simulation, path: Path) -> str:
    """The aggregated timeline: per group of :func:`groups`, the share of its clusters in
    each state per time bin (a stacked area, %), and the share of followers running an
    outer step."""
    import numpy as np

    end = min(sim.sc.timeline_s, sim.end_s)
    panels = groups(sim)
    fig, axes = plt.subplots(len(panels) + 1, 1, sharex=True,
                             figsize=(12, 1.4 + 1.25 * (len(panels) + 1)))
    hours = (np.arange(BINS) + 0.5) * end / BINS / 3600
    for ax, (label, ms) in zip(axes, panels):
        shares = [100 * occupancy([(a, b) for m in ms for st, a, b in m.timeline if st == state],
                                  end, BINS) / len(ms) for state in COLORS]
        ax.stackplot(hours, shares, colors=list(COLORS.values()), linewidth=0)
        ax.set_ylim(0, 100)
        ax.set_yticks([0, 50, 100])
        ax.set_ylabel("%", fontsize=7)
        ax.set_title(label, fontsize=8, loc="left", pad=2)
        ax.tick_params(labelsize=7)
    ax = axes[-1]
    share = 100 * occupancy([s for ld in sim.loads for s in ld.updates], end, BINS) / len(sim.loads)
    ax.fill_between(hours, share, color="#1f4e79", linewidth=0)
    ax.set_ylim(0, 100)
    ax.set_yticks([0, 50, 100])
    ax.set_ylabel("%", fontsize=7)
    ax.set_title(f"followers: {len(sim.loads)}, share running an outer step", fontsize=8,
                 loc="left", pad=2)
    ax.tick_params(labelsize=7)
    ax.set_xlim(0, end / 3600)
    ax.set_xlabel("simulated hours")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="#1f4e79"))
    height = fig.get_size_inches()[1]
    fig.suptitle(f"{sim.sc.name}: {len(sim.members)} clusters (share of each group in each "
                 f"state) and {len(sim.loads)} followers", y=1 - 0.12 / height, fontsize=9)
    fig.legend(handles, [*COLORS, "outer step"], ncol=8, fontsize=7, loc="upper center",
               bbox_to_anchor=(0.5, 1 - 0.32 / height))
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / height), h_pad=0.4)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def followers(sim: Simulation, doc: dict[str, Any], path: Path) -> str:
    """Follower utilisation (bars) and NIC rate over the window (bits/s)."""
    fs = doc["followers"]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(11, 7))
    x = range(len(fs))
    w = 0.28
    a1.bar([i - w for i in x], [100 * f["idle_frac"] for f in fs], w, label="idle", color="#9bbf85")
    a1.bar(list(x), [100 * f["cpu_busy_frac"] for f in fs], w, label="CPU (outer step)",
           color="#1f4e79")
    a1.bar([i + w for i in x], [100 * f["nic_busy_frac"] for f in fs], w, label="NIC moving data",
           color="#d95d39")
    a1.set_xticks(list(x), [f"f{f['index']}" for f in fs], fontsize=8)
    a1.set_ylabel("% of the run")
    a1.set_ylim(0, 105)
    a1.legend(fontsize=8, ncol=3)
    a1.set_title("follower utilisation")
    nic = sim.sc.followers.nic_bps / 1e9
    for load in sim.loads:
        if load.samples:
            ts = [s[0] / 3600 for s in load.samples]
            a2.step(ts, [s[1] / 1e9 for s in load.samples], where="post", lw=0.6, color="#d95d39",
                    alpha=0.5)
            a2.step(ts, [s[2] / 1e9 for s in load.samples], where="post", lw=0.6, color="#5b8e7d",
                    alpha=0.5)
    a2.axhline(nic, ls="--", color="k", lw=0.8, label=f"NIC {nic:g} Gbit/s")
    a2.plot([], [], color="#d95d39", label="in (pushes)")
    a2.plot([], [], color="#5b8e7d", label="out (pulls)")
    a2.set_xlabel("simulated hours")
    a2.set_ylabel("Gbit/s per follower")
    a2.set_xlim(0, min(sim.sc.timeline_s, sim.end_s) / 3600)
    a2.legend(fontsize=8, ncol=3, loc="upper right")
    return _save(fig, path)


def plot_all(sim: Simulation, doc: dict[str, Any], out: Path) -> list[str]:
    """Write every plot into ``out``; returns the file names."""
    return [timeline(sim, out / "timeline.png"), followers(sim, doc, out / "followers.png")]
