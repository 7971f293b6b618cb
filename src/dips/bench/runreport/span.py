"""How long a run lasted, when its training stopped, and when each member was down.

Every plot of ``dips report`` with a time axis spans the whole run (review 33 of issue 15,
M2: the timeline ended at the last round, 48 s of a run that trained 75.6 s, and the
followers' plot at their last ``applied.jsonl`` record, 8 s, so a stalled end of the run and
every follower outage were in no figure). Times are seconds since the training start
(:meth:`dips.bench.runreport.files.RunFiles.rel`).

* **The run's end** (:attr:`RunSpan.end`): the last record of any member or of the launcher
  (decision and round lines, the leader's and the launcher's events, every ``train.jsonl``
  and ``applied.jsonl`` record, the evaluations), or the stop if later: the shutdown after the
  stop is part of the run (a follower may come back, a cluster be killed then).
* **The stop** (:attr:`RunSpan.stop`): when training ended, the launcher's ``stop`` event
  (its reason: ``max time``, a budget, …), else the leader's ``run_finished``, else the
  summary's ``train_time_s``; None for a run still going.
* **Down stretches** (:func:`down_stretches`): a member is *down* from its process's exit
  with a non-zero code (the launcher's ``exited``: killed, crashed, or hung and killed by the
  supervisor), for a cluster from the leader's ``cluster_removed`` of it while the run goes
  on (from its last heartbeat, ``silent_s`` before, or its last record before the removal if
  later: a process stopped, then removed, trained nothing meanwhile), or, for a follower,
  the leader's ``follower_down``, until it is back: a cluster's next ``join`` record (one of
  the same process too, ``rejoin``) or the leader's ``cluster_joined`` of it, a follower's
  ``follower_up``, the leader's ``leader_resumed``. A stretch no record ends is *open*
  (:attr:`Stretch.open`) and drawn to the run's end.

Pure: reads the records :func:`dips.bench.runreport.files.load_run` loaded, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from dips.algo.faultlog import cluster_member, follower_member
from dips.bench.runreport.files import RunFiles, num

__all__ = ["LEADER", "RunSpan", "Stretch", "down_stretches", "run_span"]

#: The leader's member (and launcher process) name.
LEADER = "leader"

#: Launcher events that end a process: during training (``exited``) and at the shutdown.
_ENDS = ("exited", "stopped")


@dataclass(frozen=True)
class Stretch:
    """A stretch of time (seconds since the training start); ``open``: no record ends it,
    it lasts to the end of the run."""

    start: float
    end: float
    open: bool = False

    @property
    def width(self) -> float:
        return max(0.0, self.end - self.start)


@dataclass(frozen=True)
class RunSpan:
    """The run's extent (module docstring).

    Attributes:
        end: seconds from the training start to the run's last record (>= 1).
        stop: seconds to the stop (training ended), or None (not recorded: a run going on).
        stop_reason: why it stopped (``max time``, ``budget``, …), or None.
        exits: launcher process name -> [(seconds, ``exited`` or ``stopped``)] of its
            process's ends, in time order (empty without the launcher's ``events.jsonl``).
    """

    end: float
    stop: float | None = None
    stop_reason: str | None = None
    exits: dict[str, list[tuple[float, str]]] = field(default_factory=dict)

    def hold_end(self, process: str, since: float) -> tuple[float, bool]:
        """(seconds, open) where a hold (or a sync) begun at ``since`` that no record of the
        cluster ends (no ``hold_end``, sync or ``join`` after it) stops being drawn: its process's first end
        after it (not open when the process exited during training; open when it was still
        holding at the shutdown), else the run's end (open)."""
        for when, kind in self.exits.get(process, []):
            if when >= since:
                return when, kind != "exited"
        return self.end, True


def _times(recs: Iterable[dict[str, Any]]) -> Iterable[float]:
    return (t for r in recs if (t := num(r, "time")) is not None)


def run_span(run: RunFiles) -> RunSpan:
    """The :class:`RunSpan` of ``run``'s records (module docstring)."""
    streams = [run.outer_steps, run.round_ends, run.rollbacks, run.leader_events, run.events,
               run.evals, *run.clusters.values(), *run.followers.values()]
    last = max((run.rel(t) for recs in streams for t in _times(recs)), default=0.0)
    stop, reason = None, None
    for rec, kind in [(r, "stop") for r in run.events] + [
            (r, "run_finished") for r in run.leader_events]:
        if rec.get("event") == kind and (t := num(rec, "time")) is not None:
            stop, reason = run.rel(t), rec.get("reason")
            break
    if stop is None and (t := num(run.summary or {}, "train_time_s")) is not None:
        stop = t
    exits: dict[str, list[tuple[float, str]]] = {}
    for rec in run.events:
        if rec.get("event") in _ENDS and (t := num(rec, "time")) is not None:
            exits.setdefault(str(rec.get("process")), []).append((run.rel(t), rec["event"]))
    for ends in exits.values():
        ends.sort()
    return RunSpan(max(last, stop or 0.0, 1.0), stop,
                   str(reason) if isinstance(reason, str) and reason else None, exits)


def _removed_at(run: RunFiles, cid: str, t: float, silent_s: float) -> float:
    """Seconds since the start where cluster ``cid``, removed at epoch ``t`` after
    ``silent_s`` seconds without a heartbeat (e.g. SIGSTOPped), is down from: its last
    heartbeat, or its last ``train.jsonl`` record before the removal if later (it trained
    until then)."""
    last = [x for x in _times(run.clusters.get(cid, [])) if x <= t]
    return run.rel(max([t - max(0.0, silent_s), *last]))


def _marks(run: RunFiles) -> Iterable[tuple[float, int, str]]:
    """(seconds, 0 for down / 1 for back, member name) of every record that starts or ends a
    down stretch (module docstring)."""
    for rec in run.events:
        code = rec.get("returncode")
        if rec.get("event") == "exited" and isinstance(code, int) and code != 0 and (
                t := num(rec, "time")) is not None:
            yield run.rel(t), 0, str(rec.get("process"))
    for rec in run.leader_events:
        kind, t = rec.get("event"), num(rec, "time")
        if t is None:
            continue
        if kind in ("follower_down", "follower_up"):
            yield run.rel(t), int(kind == "follower_up"), follower_member(rec.get("follower"))
        elif kind == "cluster_removed" and rec.get("after_finish") is not True:
            cid = str(rec.get("cluster"))
            yield _removed_at(run, cid, t, num(rec, "silent_s") or 0.0), 0, cluster_member(cid)
        elif kind == "cluster_joined":
            yield run.rel(t), 1, cluster_member(rec.get("cluster"))
        elif kind == "leader_resumed":
            yield run.rel(t), 1, LEADER
    for cid, recs in run.clusters.items():
        for rec in recs:
            if rec.get("event") == "join" and (t := num(rec, "time")) is not None:
                yield run.rel(t), 1, cluster_member(cid)


def down_stretches(run: RunFiles, span: RunSpan | None = None) -> dict[str, list[Stretch]]:
    """Member name (``leader``, ``cluster-<id>``, ``follower-<i>``) -> the stretches it was
    down, in time order (module docstring); an open one ends at ``span.end`` (default: the
    :func:`run_span` of ``run``). Members never down are absent."""
    end = (span or run_span(run)).end
    since: dict[str, float] = {}
    out: dict[str, list[Stretch]] = {}
    for t, back, who in sorted(_marks(run)):
        if not back:
            since.setdefault(who, t)
        elif who in since:
            out.setdefault(who, []).append(Stretch(since.pop(who), t))
    for who, t in since.items():
        out.setdefault(who, []).append(Stretch(t, max(t, end), open=True))
    return {who: sorted(s, key=lambda x: x.start) for who, s in sorted(out.items())}
