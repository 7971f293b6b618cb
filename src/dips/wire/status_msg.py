"""The leader's ``GetStatus`` answer (issue 15: ``dips status``, the launcher, the evaluator):
the :class:`dips.roles.leader_types.LeaderStatus` snapshot, the last held-out record and the
faults of the last hour as one ``StatusReply``.

Every integer is saturated to int64 (issue 13: a status that fails to encode once made the
launcher's liveness probe restart a live leader); heartbeat ages are the snapshot's ``now``
(the leader's monotonic clock) minus each member's ``last_seen`` on the same clock, never
negative (a restarted leader dates its members' last heartbeat a grace period ahead).
"""

from __future__ import annotations

from typing import Any

from dips.algo.faultlog import Fault
from dips.wire import fields, heldout
from dips.wire.pb import control_pb2 as pb

#: Faults listed one by one in a reply (the newest); every fault of the window is counted.
FAULTS_LISTED = 50


def i64(v: int) -> int:
    """``v`` saturated to int64."""
    return max(min(int(v), fields.INT64_MAX), -fields.INT64_MAX - 1)


def follower_info(f: Any) -> pb.FollowerInfo:
    """A registered follower (``FollowerEntry``) as the message it registered with."""
    return pb.FollowerInfo(index=f.index, data_endpoint=f.data_endpoint,
                           control_endpoint=f.control_endpoint, layers=list(f.layers),
                           layer_bytes=[i64(b) for b in f.layer_bytes],
                           incarnation=i64(f.incarnation))


def _age(now: float | None, last_seen: float) -> float:
    return 0.0 if now is None else max(0.0, float(now) - float(last_seen))


def fault_messages(faults: list[Fault], counts: dict[tuple[str, str], int]
                   ) -> tuple[list[pb.Fault], list[pb.FaultCount]]:
    """The newest :data:`FAULTS_LISTED` of ``faults`` (newest first) and every count."""
    listed = [pb.Fault(time=f.time, kind=f.kind, member=f.member, reason=f.reason,
                       detail=f.detail[:200]) for f in faults[:FAULTS_LISTED]]
    return listed, [pb.FaultCount(kind=k, reason=r, count=i64(n))
                    for (k, r), n in sorted(counts.items())]


def status_reply(s: Any, last_eval: dict[str, Any] | None,
                 faults: tuple[list[Fault], dict[tuple[str, str], int], float] | None = None
                 ) -> pb.StatusReply:
    """The reply for snapshot ``s`` (a ``LeaderStatus``; its ``now`` is the leader's clock
    when it was taken, None: ages 0), the last held-out record ``last_eval`` (None: none) and
    ``faults`` = (faults of the window, newest first; counts by (kind, reason); the window in
    seconds), or None (no fault record: ``fault_window_s`` 0)."""
    now = getattr(s, "now", None)
    clusters = [pb.ClusterStatus(cluster_id=c.cluster_id, inner_step=i64(c.inner_step),
                                 tokens=i64(c.tokens), last_loss=c.last_loss,
                                 last_push=c.last_push, pulled_version=i64(c.pulled_version),
                                 heartbeat_age_s=_age(now, c.last_seen),
                                 tokens_pushed=i64(getattr(c, "tokens_pushed", 0)),
                                 tokens_accepted=i64(getattr(c, "tokens_accepted", 0)))
                for c in s.clusters]
    health = [pb.FollowerHealth(index=f.index, up=bool(f.up),
                                heartbeat_age_s=_age(now, f.last_seen), version=i64(f.version))
              for f in s.followers]
    n = {k: i64(v) for k, v in s.counts.items()}
    listed: list[pb.Fault] = []
    counted: list[pb.FaultCount] = []
    window_s = 0.0
    if faults is not None:
        listed, counted = fault_messages(faults[0], faults[1])
        window_s = float(faults[2])
    return pb.StatusReply(version=i64(s.version), rounds=i64(s.rounds),
                          updates_pushed=n["updates_pushed"],
                          updates_accepted=n["updates_accepted"],
                          updates_rejected=n["updates_rejected"],
                          tokens_pushed=n["tokens_pushed"], tokens_accepted=n["tokens_accepted"],
                          outer_steps=n["outer_steps"], phase=s.phase, clusters=clusters,
                          followers=[follower_info(f) for f in s.followers],
                          followers_ready=s.followers_ready,
                          accepted_windows=i64(s.accepted_windows),
                          ledger_epoch=i64(s.ledger_epoch),
                          outer_steps_lost=n["outer_steps_lost"], finished=s.finished,
                          last_eval=heldout.encode(last_eval), faults=listed,
                          fault_counts=counted, fault_window_s=window_s,
                          follower_health=health,
                          followers_configured=int(getattr(s, "followers_configured", 0)))


def followers_total(reply: pb.StatusReply) -> int:
    """The run's followers in a ``StatusReply``: its spec's count, registered or not; from an
    older leader that does not send it, those registered (review 33 of issue 15, m1: right
    after a restart "1 of 1 ready" in a 2-follower run)."""
    return max(int(reply.followers_configured), len(reply.followers))
