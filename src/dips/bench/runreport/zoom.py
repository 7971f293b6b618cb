"""Where the timeline's zoom goes (``timeline.png``'s lower panel) and what its title says.

The zoom is a stretch of the run without faults or outages (review 28 of issue 15, #4: with
dense faults it had covered half the run, a leader outage included, under a title claiming
three rounds of every cluster): about :data:`ZOOM_ROUNDS` + 1 of the slowest cluster's median
rounds wide, at most :data:`ZOOM_MAX_FRACTION` of the run, placed on the leader's rounds
(the clusters' pushes without them) where it holds the fewest faults and outages, then the
most rounds, then nearest the middle of the run; then widened (within the cap, and only
while it takes in no fault or outage) until it holds :data:`ZOOM_ROUNDS` complete rounds of
each cluster present. :class:`Zoom` says what it holds, in its :meth:`Zoom.title`.

A *fault* is any record of :func:`dips.bench.runreport.faults.fault_rows` (faults and
recoveries, the launcher's kills and stops); an *outage* is a stretch where the leader
decided no round for much longer than usual (:data:`LEADER_GAP`), a cluster ran no process
(a gap between its bars), or a member was down (its :data:`DOWN` bars, which are no
activity). Times are seconds since the training start. Pure: no I/O.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from statistics import median

__all__ = ["DOWN", "LEADER_GAP", "OPEN", "ZOOM_MAX_FRACTION", "ZOOM_ROUNDS", "Zoom", "outages",
           "rounds_of", "zoom_window"]

#: Complete rounds of every cluster the timeline's zoom holds (where the run has them).
ZOOM_ROUNDS = 3
#: The zoom's widest, as a fraction of the run.
ZOOM_MAX_FRACTION = 0.25
#: A gap between the leader's rounds longer than this many times the median gap (and than
#: 1.5 slowest cluster rounds) is an outage.
LEADER_GAP = 3.0

#: The kind of a row's bars that are a stretch it was down, not an activity.
DOWN = "down"
#: The kind repeating a row's bars that no record ends (drawn to the end of the run).
OPEN = "open"

Bars = dict[str, list[tuple[float, float]]]  # kind -> [(start s, width s)]


def _active(bars: Bars) -> list[tuple[float, float]]:
    """(start, end s) of a row's activity bars, in time order (not its down stretches)."""
    return sorted((s, s + w) for kind, bs in bars.items() if kind not in (DOWN, OPEN)
                  for s, w in bs)


@dataclass(frozen=True)
class Zoom:
    """The zoom: ``lo``..``hi`` seconds; ``faults``: fault records in it; ``outages``: outage
    stretches it overlaps; ``rounds``: complete rounds in it of each cluster present in it;
    ``span``: the run's length (seconds)."""

    lo: float
    hi: float
    faults: int
    outages: int
    span: float
    rounds: dict[str, int] = field(default_factory=dict)

    def title(self) -> str:
        """What the zoom shows, in words (never more than it holds)."""
        width = self.hi - self.lo
        part = f"{100 * width / self.span:.0f}% of the run" if self.span > 0 else ""
        if self.faults or self.outages:
            clean = (f"{self.faults} fault records and {self.outages} outages in it "
                     "(no stretch this wide is free of them)")
        else:
            clean = "no fault or outage in it"
        rounds = ", ".join(f"{c} {n}" for c, n in self.rounds.items()) or "none"
        return (f"zoom: {width:.1f} s from {self.lo:.1f} s ({part}), {clean}\n"
                f"complete rounds in it: {rounds}")


def rounds_of(bars: Bars) -> list[tuple[float, float]]:
    """A cluster's complete rounds (start, end s): from one sync's end (its pull's) to the
    next's, which holds the inner steps, push, wait and pull of that sync."""
    ends = sorted(s + w for s, w in bars["pull"])
    return list(zip(ends, ends[1:]))


def _period(bars: Bars) -> float | None:
    r = rounds_of(bars)
    return median(e - s for s, e in r) if r else None


def outages(leader: Bars, rows: dict[str, Bars]) -> list[tuple[float, float]]:
    """The outage stretches (start, end s), in time order (module docstring)."""
    periods = [p for b in rows.values() if (p := _period(b)) is not None]
    out: list[tuple[float, float]] = []
    ends = sorted(s + w for s, w in leader.get("update", []))
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    if gaps:
        limit = max(LEADER_GAP * median(gaps), 1.5 * max(periods, default=0.0))
        out += [(a, b) for a, b in zip(ends, ends[1:]) if b - a > limit]
    for b in [leader, *rows.values()]:
        out += [(s, s + w) for s, w in b.get(DOWN, [])]
    for b in rows.values():
        spans = _active(b)
        limit = max(0.5, 0.5 * (_period(b) or 0.0))
        reach = None
        for s, e in spans:
            if reach is not None and s - reach > limit:
                out.append((reach, s))
            reach = e if reach is None else max(reach, e)
    return sorted(out)


def zoom_window(leader: Bars, rows: dict[str, Bars], span: float,
                faults: list[float] | None = None) -> Zoom:
    """The zoom of the module docstring for the leader's bars, the clusters' ``rows``, a
    run of ``span`` seconds and the times of its fault records ``faults``."""
    points = sorted(faults or [])
    gone = outages(leader, rows)

    def bad(lo: float, hi: float) -> tuple[int, int]:
        return (bisect_right(points, hi) - bisect_left(points, lo),
                sum(1 for a, b in gone if a < hi and b > lo))

    periods = [p for b in rows.values() if (p := _period(b)) is not None]
    cap = max(ZOOM_MAX_FRACTION * span, 1e-9)
    width = min((ZOOM_ROUNDS + 1) * max(periods) if periods else span / 10, cap)
    marks = sorted(s for s, _ in leader.get("update", [])) or sorted(
        s for b in rows.values() for s, _ in b["push"])
    if not marks:
        lo = max(0.0, span / 2 - width / 2)
    else:
        def place(c: float) -> float:
            return min(max(0.0, c - width / 2), max(0.0, span - width))

        def score(c: float) -> tuple:
            lo = place(c)
            f, o = bad(lo, lo + width)
            return (f + o, -(bisect_right(marks, lo + width) - bisect_left(marks, lo)),
                    abs(c - span / 2))

        lo = place(min(marks, key=score))
    hi = lo + width
    here = bad(lo, hi)
    wanted = [e for b in rows.values()
              if (inside := [e for s, e in rounds_of(b) if s >= lo])
              for e in inside[:ZOOM_ROUNDS]]
    for e in sorted(x for x in wanted if hi < x <= lo + cap):  # widen while it stays clean
        if bad(lo, e) != here:
            break
        hi = e
    counts = {cid: sum(1 for s, e in rounds_of(b) if lo <= s and e <= hi)
              for cid, b in rows.items()
              if any(s < hi and e > lo for s, e in _active(b))}
    return Zoom(lo, hi, *here, span=span, rounds=counts)
