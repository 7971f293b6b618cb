"""The faults of a run, for ``dips report``: what went wrong, when, to whom, and its recovery.

Two sources, both records the run writes anyway:

* the **leader's** (``leader_events.jsonl``, ``outer_steps.jsonl``): every fault of
  :func:`dips.algo.faultlog.faults_of` (the same rule ``dips status`` shows: members removed,
  followers down or restarted, pushes rejected by their typed reason, commit failures,
  rollbacks, the leader's own restarts), and the recoveries it records: a follower up again
  after it was down (``follower_up``), a cluster that joined again (``cluster_joined`` with
  ``rejoin``);
* the **launcher's** (``events.jsonl`` of ``dips launch``; absent in a run deployed by hand):
  faults it injected (``fault``: ``kill``, ``stop``, ``cut_link``; ``fault_cleared``), a
  process that exited with a non-zero code, and its restarts by the supervisor.

Rows are in time order; their time is seconds since the run's training start
(:meth:`dips.bench.runreport.files.RunFiles.rel`). Pushes rejected are many and alike, so the
table lists them only counted (by reason, :func:`rejections`), not one row each.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from dips.algo.faultlog import cluster_member, faults_of, follower_member, reason_class
from dips.bench.runreport.files import RunFiles, num

__all__ = ["FaultRow", "fault_counts", "fault_rows", "rejections"]

#: Launcher events of a finished or starting run that are not faults; ``killed`` is the
#: launcher's own shutdown (a process that did not stop within ``shutdown_s`` of its SIGTERM,
#: :meth:`dips.emu.children.Launch.stop`): not a fault of the run (review 33 of issue 15, m3).
_QUIET = {"start", "stop", "stopped", "network", "interrupt", "fault_armed", "final_eval_asked",
          "killed"}


@dataclass(frozen=True)
class FaultRow:
    """One fault or recovery of the run.

    Attributes:
        time_s: seconds since the training start.
        kind: e.g. ``cluster_removed``, ``follower_down``, ``follower_up``, ``kill``,
            ``restart``, ``leader_restarted`` (module docstring).
        member: ``cluster-<id>``, ``follower-<i>``, ``leader``, ``evaluator`` or the
            launcher's process name.
        reason: a bounded class ("" when the kind has none).
        detail: free text for people.
        source: ``leader`` or ``launcher``: whose record it is.
    """

    time_s: float
    kind: str
    member: str
    reason: str
    detail: str
    source: str


def _leader_recoveries(run: RunFiles) -> list[FaultRow]:
    out = []
    down: set[Any] = set()
    for rec in run.leader_events:
        t, kind = num(rec, "time"), rec.get("event")
        if t is None:
            continue
        if kind == "follower_down":
            down.add(rec.get("follower"))
        elif kind == "follower_up" and rec.get("follower") in down:
            down.discard(rec.get("follower"))
            out.append(FaultRow(run.rel(t), "follower_up", follower_member(rec.get('follower')),
                                "", "serving again", "leader"))
        elif kind == "cluster_joined" and rec.get("rejoin") is True:
            out.append(FaultRow(run.rel(t), "cluster_rejoined", cluster_member(rec.get('cluster')),
                                "", f"at version {rec.get('version')}", "leader"))
    return out


def _launcher_rows(run: RunFiles) -> list[FaultRow]:
    out = []
    for rec in run.events:
        t, kind = num(rec, "time"), rec.get("event")
        if t is None or not isinstance(kind, str) or kind in _QUIET:
            continue
        who = str(rec.get("process", ""))
        if kind == "exited":
            code = rec.get("returncode")
            if code == 0:
                continue
            out.append(FaultRow(run.rel(t), "exited", who, "", f"exit code {code}", "launcher"))
        elif kind in ("fault", "fault_cleared"):
            action = str(rec.get("action", "?"))
            extra = (f" for {rec['duration_s']} s" if num(rec, "duration_s") is not None
                     else f" at phase {rec['phase']}" if rec.get("phase") else "")
            out.append(FaultRow(run.rel(t), action if kind == "fault" else f"{action}_cleared",
                                who, "injected", f"{kind}{extra}", "launcher"))
        elif kind == "restart":
            out.append(FaultRow(run.rel(t), "restart", who, "", "restarted by the supervisor",
                                "launcher"))
        else:
            detail = " ".join(f"{k}={v}" for k, v in rec.items()
                              if k not in ("time", "event", "process"))
            out.append(FaultRow(run.rel(t), kind, who, "", detail[:120], "launcher"))
    return out


def fault_rows(run: RunFiles) -> list[FaultRow]:
    """Every fault and recovery of the run but the rejected pushes (module docstring), in
    time order."""
    rows = []
    for stream, recs in (("leader_events", run.leader_events),
                         ("outer_steps", run.round_ends),
                         ("outer_steps", run.outer_steps)):
        for rec in recs:
            for f in faults_of(stream, rec):
                if f.kind != "push_rejected":
                    rows.append(FaultRow(run.rel(f.time), f.kind, f.member, f.reason, f.detail,
                                         "leader"))
    rows += _leader_recoveries(run) + _launcher_rows(run)
    return sorted(rows, key=lambda r: (r.time_s, r.source, r.kind, r.member))


def fault_counts(rows: list[FaultRow]) -> dict[str, int]:
    """Rows counted by kind (``kind`` or ``kind (reason)``), in order of the first row."""
    return dict(Counter(f"{r.kind} ({r.reason})" if r.reason else r.kind for r in rows))


def rejections(run: RunFiles) -> dict[str, int]:
    """Rejected pushes counted by their typed reason (:func:`dips.algo.faultlog.reason_class`:
    the record's ``code``; ``other`` for an older file without codes), most first."""
    counts = Counter(reason_class(why) for rec in run.outer_steps
                     for why in (rec.get("rejected") or {}).values())
    return dict(counts.most_common())
