"""PNG plots of ``dips simulate`` (matplotlib, Agg backend), over the first ``timeline_s`` s.

* ``timeline.png``: one row per cluster, coloured by state (compute, admit, push, verdict,
  pull, join, down), and one row per follower with its outer steps (CPU busy);
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

__all__ = ["plot_all"]

COLORS = {"compute": "#4c9f70", "admit": "#f2c14e", "push": "#d95d39", "verdict": "#f78154",
          "pull": "#5b8e7d", "join": "#7d5ba6", "down": "#333333"}


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def timeline(sim: Simulation, path: Path) -> str:
    """Per-cluster states and per-follower outer steps over the window (hours)."""
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
    a2.legend(fontsize=8, ncol=3)
    return _save(fig, path)


def plot_all(sim: Simulation, doc: dict[str, Any], out: Path) -> list[str]:
    """Write every plot into ``out``; returns the file names."""
    return [timeline(sim, out / "timeline.png"), followers(sim, doc, out / "followers.png")]
