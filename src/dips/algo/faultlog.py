"""The faults the leader records, and those of the last hour (issue 15: ``dips status``; §16:
a fault reported actively is found far sooner than one inferred from throughput or loss).

Pure: a fault comes from a record the leader writes anyway (a line of ``leader_events.jsonl``
or of ``outer_steps.jsonl``, each with its epoch-second ``time``), and the caller passes
``now`` in. :func:`faults_of` turns one record into the faults it reports; :class:`FaultLog`
keeps the newest :data:`KEEP` and answers what happened in the last ``window_s`` seconds.

Kinds (``member``: ``cluster-<id>``, ``follower-<i>`` or ``leader``) and their reasons:

==================== ========================================== ===============================
kind                 record                                      reason
==================== ========================================== ===============================
push_rejected        a decision line's ``rejected`` pushes       :func:`reason_class`
cluster_removed      ``cluster_removed``                         heartbeat_timeout,
                                                                 base_version_ahead, other
follower_down        ``follower_down``                           heartbeat_timeout, data_plane
follower_restarted   ``follower_up`` with ``restarted``          (none)
chunks_reassigned    ``chunks_reassigned`` (member: the idle     idle
                     holder)
commit_failed        a ``round_end`` line's ``commit_failed``    (none)
rollback             ``reconciled`` with ``lost`` > 0            (none)
reconcile_failed     ``reconcile_failed``                        (none)
leader_restarted     ``leader_resumed``                          (none)
leader_stepped_down  ``leader_stepped_down``                     (none)
==================== ========================================== ===============================

A graceful leave (``cluster_left``), a join, a follower's first registration, the run's end
and a cluster removed for silence after the run finished (``after_finish``: a member that
stopped without leaving a finished run, review 28 of issue 15, #3) are not faults.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable

from dips.algo.round_types import RejectCode

__all__ = ["FAULT_WINDOW_S", "KEEP", "REASONS", "Fault", "FaultLog", "cluster_member",
           "faults_of", "follower_member", "reason_class"]


def cluster_member(cluster_id: Any) -> str:
    """A cluster's member name, ``cluster-<id>``: the one name faults, ``dips status``, the
    report and the ``member`` label of ``dips_heartbeat_age_seconds`` give it."""
    return f"cluster-{cluster_id}"


def follower_member(index: Any) -> str:
    """A follower's member name, ``follower-<index>`` (as :func:`cluster_member`)."""
    return f"follower-{index}"

#: Seconds of history ``GetStatus`` reports faults of.
FAULT_WINDOW_S = 3600.0
#: Faults a :class:`FaultLog` keeps (the newest); a leader's memory stays bounded whatever
#: a flapping member does.
KEEP = 10_000
#: Bounded values of a rejected push's reason (see :func:`reason_class`).
REASONS = tuple(c.value for c in RejectCode)


@dataclass(frozen=True)
class Fault:
    """One fault: when (epoch seconds), what, which member, why (a bounded class, "" when
    the kind has none) and a short free-text detail."""

    time: float
    kind: str
    member: str
    reason: str = ""
    detail: str = ""


def reason_class(why: Any) -> str:
    """The bounded reason (one of :data:`REASONS`) of a rejected push: the ``code`` its
    ``outer_steps.jsonl`` entry carries (:class:`dips.algo.round_types.RejectCode`, set
    where the push failed), ``other`` for an entry without a valid one (an older file). The
    free-text ``reason`` beside it is for people and is never read here."""
    code = why.get("code") if isinstance(why, dict) else None
    return code if isinstance(code, str) and code in REASONS else RejectCode.OTHER.value


def _num(rec: dict[str, Any], key: str) -> float | None:
    v = rec.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _short(value: Any, n: int = 120) -> str:
    text = str(value)
    return text if len(text) <= n else text[:n] + "..."


def _event(t: float, rec: dict[str, Any]) -> list[Fault]:
    kind = rec.get("event")
    if kind == "cluster_removed":
        if rec.get("after_finish") is True:  # gone after the run finished: its clean end
            return []
        member = cluster_member(rec.get('cluster'))
        if "silent_s" in rec:
            return [Fault(t, kind, member, "heartbeat_timeout",
                          f"silent for {_num(rec, 'silent_s') or 0:.1f} s")]
        if "base_version" in rec:
            return [Fault(t, kind, member, "base_version_ahead",
                          f"pushed base version {rec['base_version']} ahead of version "
                          f"{rec.get('version')}")]
        return [Fault(t, kind, member, "other", _short(rec.get("reason", "")))]
    if kind == "follower_down":
        member = follower_member(rec.get('follower'))
        if "silent_s" in rec:
            return [Fault(t, kind, member, "heartbeat_timeout",
                          f"silent for {_num(rec, 'silent_s') or 0:.1f} s")]
        return [Fault(t, kind, member, "data_plane", _short(rec.get("error", "")))]
    if kind == "follower_up" and rec.get("restarted"):
        return [Fault(t, "follower_restarted", follower_member(rec.get('follower')), "",
                      f"incarnation {rec.get('incarnation')}")]
    if kind == "chunks_reassigned":
        chunks = rec.get("chunks") or []
        return [Fault(t, kind, cluster_member(rec.get('idle_holder')), "idle",
                      f"{len(chunks)} chunks to cluster-{rec.get('cluster')}")]
    if kind == "reconciled" and (_num(rec, "lost") or 0) > 0:
        return [Fault(t, "rollback", "leader", "",
                      f"{int(rec['lost'])} outer steps lost, back to version {rec.get('version')}")]
    if kind == "reconcile_failed":
        return [Fault(t, kind, "leader", "", _short(rec.get("error", "")))]
    if kind == "leader_resumed":
        return [Fault(t, "leader_restarted", "leader", "",
                      f"resumed at version {rec.get('version')}")]
    if kind == "leader_stepped_down":
        return [Fault(t, kind, "leader", "", _short(rec.get("reason", "")))]
    return []


def faults_of(stream: str, rec: Any) -> list[Fault]:
    """The faults one record reports (none for most): ``stream`` is ``"leader_events"`` or
    ``"outer_steps"``; a record without a numeric ``time`` (epoch s) or not a dict reports
    none."""
    if not isinstance(rec, dict):
        return []
    t = _num(rec, "time")
    if t is None:
        return []
    if stream == "leader_events":
        return _event(t, rec)
    if stream != "outer_steps":
        return []
    if rec.get("event") == "round_end":
        return [Fault(t, "commit_failed", follower_member(i), "", f"round {rec.get('round')}")
                for i in rec.get("commit_failed") or []]
    if "event" in rec or "accepted" not in rec:
        return []
    out = []
    for cluster, why in sorted((rec.get("rejected") or {}).items()):
        text = why.get("reason", "") if isinstance(why, dict) else why
        out.append(Fault(t, "push_rejected", cluster_member(cluster), reason_class(why),
                         f"round {rec.get('round')}: {_short(text, 80)}"))
    return out


class FaultLog:
    """The newest ``keep`` faults, and those of the last ``window_s`` seconds.

    Args:
        window_s: seconds of history :meth:`recent` and :meth:`counts` cover (> 0).
        keep: faults kept (>= 1; older ones are forgotten even within the window).

    Raises:
        ValueError: naming the argument and its value.
    """

    def __init__(self, window_s: float = FAULT_WINDOW_S, keep: int = KEEP) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s = {window_s!r}: must be > 0 (seconds)")
        if keep < 1:
            raise ValueError(f"keep = {keep!r}: must be >= 1 (faults)")
        self.window_s = float(window_s)
        self._faults: deque[Fault] = deque(maxlen=keep)

    def add(self, faults: Iterable[Fault]) -> None:
        """Remember ``faults`` (in any time order)."""
        self._faults.extend(faults)

    def recent(self, now: float, limit: int | None = None) -> list[Fault]:
        """The faults of the window ending at ``now`` (epoch s), newest first; at most
        ``limit`` (None: all kept)."""
        since = now - self.window_s
        out = sorted((f for f in self._faults if since <= f.time <= now),
                     key=lambda f: (-f.time, f.kind, f.member))
        return out if limit is None else out[:limit]

    def counts(self, now: float) -> dict[tuple[str, str], int]:
        """(kind, reason) -> faults of the window ending at ``now``, in that order."""
        out: dict[tuple[str, str], int] = {}
        for f in self.recent(now):
            out[f.kind, f.reason] = out.get((f.kind, f.reason), 0) + 1
        return dict(sorted(out.items()))
