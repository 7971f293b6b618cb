"""``dips status --leader HOST:PORT``: one screen of the run as the leader sees it.

It calls the leader's ``GetStatus`` over the same channel as the roles (mutual TLS with a
bundle from ``dips init``, normally the operator's ``pki/admin``, or ``--insecure``) and shows
the members (clusters: inner step and tokens trained as its last heartbeat said, in the
cluster's own numbering, which a resumed process counts on, and ``tokens_trained``: that but
never below its tokens pushed, so never below its tokens accepted, whatever a heartbeat lags;
tokens accepted and pushed over all its processes, the leader's ledger counts; last loss,
last verdict, pulled version, staleness, heartbeat age; followers: every one of the run,
registered or not (the run's count from the leader, not who has reported yet), up, version,
heartbeat age), the global version, rounds, phase,
counts, whether the run finished, the last held-out loss ``dips evaluate`` reported, and the
faults the leader recorded in the last hour (members removed, followers down or restarted,
pushes rejected by reason, rollbacks, ...: :mod:`dips.algo.faultlog`), the newest listed and
all counted. ``--watch`` redraws it in place; ``--json`` prints :func:`snapshot`'s object.

Besides the leader's record, :class:`Faults` derives *conditions* from what successive
answers show (a follower not ready now, a cluster whose last push was rejected, one without a
new inner step for a while; see its docstring).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from dips.algo.consumed import trained_at_least
from dips.algo.faultlog import cluster_member, follower_member
from dips.wire.status_msg import followers_total

if TYPE_CHECKING:
    from dips.wire.pb import control_pb2 as pb

#: How long (seconds) a fault that no longer holds stays listed.
FAULT_WINDOW_S = 3600.0
#: A cluster whose inner step and tokens stay the same this long (seconds) is listed as
#: ``no_progress`` (it may still heartbeat: a stuck training loop).
QUIET_AFTER_S = 300.0

_COUNTS = ("updates_pushed", "updates_accepted", "updates_rejected", "tokens_pushed",
           "tokens_accepted", "outer_steps_lost")


def staleness(version: int, pulled_version: int) -> int | None:
    """Versions a cluster is behind: the leader's ``version`` minus the version it last
    reported pulling; None when it has reported no pull yet (``pulled_version`` -1)."""
    return None if pulled_version < 0 else version - pulled_version


def _follower_up(ready: int, total: int) -> bool | None:
    """Whether each follower is up, as far as the count of ready followers tells: True when
    all are, False when none is, None (unknown per follower) in between."""
    if ready >= total:
        return True
    return False if ready <= 0 else None


def _age(value: float, known: bool) -> float | None:
    return round(value, 3) if known else None


def snapshot(reply: pb.StatusReply, leader: str, now: float) -> dict[str, Any]:
    """The JSON object of ``dips status --json`` for ``reply`` from ``leader`` at ``now``
    (epoch seconds). Its keys are stable (README "dips status"); ``conditions`` is empty here
    (:meth:`Faults.update` fills it). An older leader (no fault record, ``fault_window_s``
    0) gives null heartbeat ages, follower versions and fault window, and no faults."""
    total, ready = followers_total(reply), reply.followers_ready
    known = reply.fault_window_s > 0  # a leader that sends ages and faults
    clusters = [{"cluster_id": c.cluster_id, "inner_step": c.inner_step, "tokens": c.tokens,
                 "tokens_trained": trained_at_least(c.tokens, c.tokens_pushed),
                 "tokens_accepted": c.tokens_accepted, "tokens_pushed": c.tokens_pushed,
                 "last_loss": c.last_loss if math.isfinite(c.last_loss) else None,
                 "last_push": c.last_push,
                 "pulled_version": c.pulled_version if c.pulled_version >= 0 else None,
                 "staleness": staleness(reply.version, c.pulled_version),
                 "heartbeat_age_s": _age(c.heartbeat_age_s, known)}
                for c in sorted(reply.clusters, key=lambda c: c.cluster_id)]
    health = {h.index: h for h in reply.follower_health}
    followers = []
    for f in sorted(reply.followers, key=lambda f: f.index):
        h = health.get(f.index)
        followers.append({
            "index": f.index, "registered": True,
            "up": _follower_up(ready, total) if h is None else h.up,
            "version": None if h is None else h.version, "incarnation": f.incarnation,
            "control_endpoint": f.control_endpoint, "data_endpoint": f.data_endpoint,
            "layers": len(f.layers),
            "heartbeat_age_s": None if h is None else _age(h.heartbeat_age_s, True)})
    registered = {f.index for f in reply.followers}
    for i in (i for i in range(total) if i not in registered):  # e.g. a restarted leader's
        followers.append({"index": i, "registered": False, "up": False, "version": None,
                          "incarnation": None, "control_endpoint": None,
                          "data_endpoint": None, "layers": None, "heartbeat_age_s": None})
    followers.sort(key=lambda f: f["index"])
    return {"leader": leader, "time": round(now, 3), "reachable": True, "version": reply.version,
            "outer_steps": reply.outer_steps, "rounds": reply.rounds, "phase": reply.phase,
            "finished": bool(reply.finished), "finished_reason": reply.finished,
            "counts": {k: getattr(reply, k) for k in _COUNTS},
            "ledger": {"epoch": reply.ledger_epoch, "accepted_windows": reply.accepted_windows},
            "followers_ready": ready, "followers_total": total,
            "clusters": clusters, "followers": followers, "heldout": _heldout(reply),
            "fault_window_s": reply.fault_window_s if known else None,
            "faults": [{"time": round(f.time, 3), "kind": f.kind, "member": f.member,
                        "reason": f.reason, "detail": f.detail} for f in reply.faults],
            "fault_counts": [{"kind": c.kind, "reason": c.reason, "count": c.count}
                             for c in reply.fault_counts],
            "conditions": []}


def unreachable(leader: str, error: str, now: float,
                last: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON object ``dips status --watch --json`` prints for a look the leader did not
    answer (a leader down or restarting): ``leader``, ``time`` (epoch s), ``reachable``
    false, ``error`` (why), ``last_answer`` (epoch s of the last answer, null before any)."""
    return {"leader": leader, "time": round(now, 3), "reachable": False, "error": error,
            "last_answer": None if last is None else last.get("time")}


def _heldout(reply: pb.StatusReply) -> dict[str, Any] | None:
    """The last held-out evaluation the leader recorded (``dips evaluate``, issue 15):
    ``version``, ``eval_loss`` (nats/token), ``perplexity`` (null where it overflows),
    ``tokens_accepted`` (null: unknown), ``eval_tokens``, ``time`` (epoch s); None: none yet."""
    from dips.wire.heldout import last_eval

    return last_eval(reply)


class Faults:
    """Conditions derived from successive snapshots, beside the faults the leader recorded.

    Each fault is ``{"kind", "member", "detail", "since", "last", "active"}``: ``since`` and
    ``last`` are the epoch seconds of the first and latest answer that showed it, ``active``
    whether the latest one does. Kinds: ``follower_down`` (fewer followers ready than
    registered), ``push_rejected`` (a cluster's last verdict), ``cluster_gone`` (a cluster
    listed before is no longer a member: removed or left while the run goes on; none in a
    look that says the run finished, as the clusters leave a finished run), ``follower_restarted`` (a new
    incarnation), ``outer_steps_lost`` (rolled back since the previous answer) and
    ``no_progress`` (a cluster's inner step and tokens unchanged for ``quiet_after_s``
    seconds while the run goes on). One answer shows only the first two; the others need
    ``--watch``. A fault that no longer holds is dropped ``window_s`` seconds after it was
    last seen.
    """

    def __init__(self, quiet_after_s: float = QUIET_AFTER_S,
                 window_s: float = FAULT_WINDOW_S) -> None:
        self.quiet_after_s, self.window_s = quiet_after_s, window_s
        self._faults: dict[tuple[str, str], dict[str, Any]] = {}
        self._prev: dict[str, Any] | None = None
        self._moved: dict[str, tuple[tuple[int, int], float]] = {}  # cluster -> (progress, t)

    def update(self, doc: dict[str, Any]) -> list[dict[str, Any]]:
        """Take one :func:`snapshot`; returns (and stores in ``doc["conditions"]``) the
        conditions active now or seen within the window, newest first."""
        now = doc["time"]
        seen: dict[tuple[str, str], str] = {}
        if doc["followers_ready"] < doc["followers_total"]:
            seen["follower_down", "followers"] = (f"{doc['followers_ready']} of "
                                                  f"{doc['followers_total']} followers ready")
        for c in doc["clusters"]:
            member = cluster_member(c['cluster_id'])
            if c["last_push"] == "rejected":
                seen["push_rejected", member] = "its last push was rejected"
            progress = (c["inner_step"], c["tokens"])
            before = self._moved.get(member)
            if before is None or before[0] != progress:
                self._moved[member] = (progress, now)
            elif not doc["finished"] and now - before[1] >= self.quiet_after_s:
                seen["no_progress", member] = (f"inner step {progress[0]} for "
                                               f"{now - before[1]:.0f} s")
        if self._prev is not None:
            seen.update(self._changes(self._prev, doc))
        for key, detail in seen.items():
            fault = self._faults.get(key)
            if fault is None or not fault["active"]:
                fault = {"kind": key[0], "member": key[1], "since": now}
                self._faults[key] = fault
            fault.update(detail=detail, last=now, active=True)
        for key, fault in list(self._faults.items()):
            if key not in seen:
                fault["active"] = False
                if now - fault["last"] > self.window_s:
                    del self._faults[key]
        self._prev = doc
        doc["conditions"] = sorted(({k: f[k] for k in ("kind", "member", "detail", "since",
                                                       "last", "active")}
                                    for f in self._faults.values()),
                                   key=lambda f: (-f["last"], f["kind"], f["member"]))
        return doc["conditions"]

    def _changes(self, prev: dict[str, Any], doc: dict[str, Any]) -> dict[tuple[str, str], str]:
        """The faults that only a change between two answers shows."""
        out: dict[tuple[str, str], str] = {}
        present = {cluster_member(c["cluster_id"]) for c in doc["clusters"]}
        # Clusters leave a finished run: no departure counts in a look that says finished.
        # The leader records a cluster's leave and the finish within milliseconds in either
        # order, so one that left just before the look that first says finished is not gone
        # either (review 26, M1).
        if not doc["finished"]:
            for c in prev["clusters"]:
                if cluster_member(c["cluster_id"]) not in present:
                    out["cluster_gone", cluster_member(c['cluster_id'])] = "no longer a member"
            for (kind, member), fault in self._faults.items():  # still absent: it holds
                if (kind == "cluster_gone" and fault["active"]
                        and member not in present):
                    out[kind, member] = fault["detail"]
        before = {f["index"]: f["incarnation"] for f in prev["followers"]
                  if f["incarnation"] is not None}  # (not registered yet: unknown)
        for f in doc["followers"]:
            if (f["index"] in before and f["incarnation"] is not None
                    and before[f["index"]] != f["incarnation"]):
                out["follower_restarted", follower_member(f['index'])] = (
                    f"incarnation {before[f['index']]} -> {f['incarnation']}")
        lost = doc["counts"]["outer_steps_lost"] - prev["counts"]["outer_steps_lost"]
        if lost > 0:
            out["outer_steps_lost", "leader"] = (f"{lost} outer steps rolled back (total "
                                                 f"{doc['counts']['outer_steps_lost']})")
        return out
