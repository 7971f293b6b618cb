"""gRPC servicers and clients for the leader and followers (thin: decode, check, call, encode).

The servicers translate protobuf messages to plain Python calls on a role object (duck-typed,
so this module imports nothing from :mod:`dips.roles`) and map domain errors to status codes
through :func:`dips.wire.control.grpc_errors`. Blocking leader calls (push admission and the
verdict) take their deadline from the gRPC context.

Who may call what is decided here, from the caller's certificate
(:func:`dips.wire.security.caller`), never from the request body: a cluster acts only as
itself (a ``cluster_id`` in the body must be its own) and only while its id is not revoked;
only follower *i* registers as follower *i*; only the leader calls a follower's control
service, and only with a term the follower's fence admits (:mod:`dips.algo.fencing`).

Hostile members (issue 13): after the caller is known, the leader's calls pass a
:class:`dips.wire.inflight.CallGate` (a member over its limits: refusal BUSY, at once) before
any work on the request (review 21, F2), then the check of its message in
:mod:`dips.wire.fields` before any field is used (a bad field: refusal INVALID_ARGUMENT naming
it); its waiting calls end when their caller cancels. Every exception of a call ends that call only (:func:`dips.wire.control.grpc_errors`).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

import grpc

from dips.algo.refusal import Refusal, Refused
from dips.wire import fields, heldout
from dips.wire.control import Client, grpc_errors, refusal_of
from dips.wire.inflight import CallGate
from dips.wire.pb import control_pb2 as pb
from dips.wire.pb import control_pb2_grpc as pbg
from dips.wire.pki import Identity
from dips.wire.ratelog import RateLimitedLog, Tally
from dips.wire.security import Credentials, caller, require
from dips.wire.status_msg import follower_info, status_reply

log = logging.getLogger(__name__)

TERM_KEY = "dips-term"
#: Seconds between two log lines of one member's refusals of one kind (review 21, F3).
REFUSAL_LOG_S = 60.0


def _time_left(context: grpc.ServicerContext, default_s: float = 60.0) -> float:
    left = context.time_remaining()
    return default_s if left is None else max(0.0, left - 0.2)


def _cancelled(context: grpc.ServicerContext) -> Callable[[], bool]:
    """Whether the caller gave up (cancelled, or its deadline passed): a waiting call then
    ends at once instead of holding its thread (and its member's place) to the deadline."""
    return lambda: not context.is_active()


def _no_revocations() -> frozenset[str]:
    return frozenset()


class LeaderServicer(pbg.LeaderServicer):
    """Serves :class:`dips.roles.leader.Leader` over gRPC.

    Args:
        leader: the role object.
        make_follower_entry: ``pb.FollowerInfo -> FollowerEntry`` (the role's dataclass).
        revoked: the cluster ids refused from now on (read at every cluster call, so an
            operator's ``dips init --revoke`` takes effect without a restart).
        gate: the per-member call limits (default: those of a 32-thread server; give
            :meth:`CallGate.for_server` of the server's ``max_workers``).
        refusals: counts every refused call by (caller, method, refusal name) (the leader's
            ``dips_refusals_total``; default: its own, :attr:`refusals`).

    Every refusal is counted, and logged at INFO at most once per (caller, refusal) per
    :data:`REFUSAL_LOG_S` s (review 21, F3: a member's refusals grew the log 195 KB/s).
    """

    def __init__(self, leader: Any, make_follower_entry: Any,
                 revoked: Callable[[], frozenset[str]] = _no_revocations,
                 gate: CallGate | None = None, refusals: Tally | None = None) -> None:
        self.leader = leader
        self._entry = make_follower_entry
        self._revoked = revoked
        self.gate = gate or CallGate.for_server(32)
        self.refusals = refusals if refusals is not None else Tally()
        self._refusal_log = RateLimitedLog(log, REFUSAL_LOG_S)

    def on_refused(self, context: Any, method: str, code: Refusal, message: str) -> None:
        """Count and (rate-limited) log one refused call (:func:`dips.wire.control.grpc_errors`
        calls it)."""
        try:
            who = caller(context).name
        except Refused:
            who = "(unknown)"
        self.refusals.add((who, method, code.name))
        self._refusal_log.info((who, code.name), "refused %s %s: %s: %s", who, method,
                               code.name, fields.text(message, 300))

    def _caller(self, context: Any, what: str) -> Identity:
        """Who calls, from its certificate; a revoked cluster is refused every call, reads
        (``GetSpec``, ``GetStatus``) included. Raises Refused(FORBIDDEN)."""
        who = caller(context)
        if who.role == "cluster" and who.id in self._revoked():
            raise Refused(Refusal.FORBIDDEN, f"{what}: cluster {who.id!r} is revoked")
        return who

    def _cluster(self, context: Any, claimed: str, what: str) -> str:
        """The calling cluster's id, from its certificate; a ``cluster_id`` in the body must
        be the same. Raises Refused(FORBIDDEN)."""
        who = self._caller(context, what)
        require(who, "cluster", what)
        if claimed and claimed != who.id:
            raise Refused(Refusal.FORBIDDEN, f"{what}: field 'cluster_id' = {claimed!r}, but the "
                                             f"caller's certificate is {who.name!r}")
        return who.id

    @grpc_errors
    def RegisterFollower(self, request: pb.FollowerInfo, context: Any) -> pb.RegisterReply:
        who = caller(context)
        require(who, "follower", "RegisterFollower")
        if who.index != request.index:
            raise Refused(Refusal.FORBIDDEN, f"RegisterFollower: field 'index' = {request.index}, "
                                             f"but the caller's certificate is {who.name!r}")
        with self.gate.enter(who.name, "RegisterFollower"):
            info = fields.follower_info(request, self.leader.cfg.followers)
            reply = self.leader.register_follower(self._entry(info))
        return pb.RegisterReply(term=reply.term, data_secret=reply.data_secret,
                                encrypt=reply.encrypt, member_keys=list(reply.member_keys),
                                next_key_seq=reply.next_key_seq)

    @grpc_errors
    def GetSpec(self, request: pb.SpecRequest, context: Any) -> pb.SpecReply:
        who = self._caller(context, "GetSpec")
        with self.gate.enter(who.name, "GetSpec"):
            spec, fingerprint = self.leader.spec_json()
        return pb.SpecReply(run_spec=spec, fingerprint=fingerprint, term=self.leader.term)

    @grpc_errors
    def JoinCluster(self, request: pb.JoinRequest, context: Any) -> pb.JoinReply:
        who = self._caller(context, "JoinCluster")
        with self.gate.enter(who.name, "JoinCluster"):
            # Read before the join: a follower marked down after it moves the epoch the
            # member's pull compares with; one down before it was refused the join.
            epoch = self.leader.followers_epoch
            if who.role == "admin":  # an observer: pulls the model, never pushes (no membership)
                version, followers, key = self.leader.join_observer(who.name)
            else:
                cid = self._cluster(context, request.cluster_id, "JoinCluster")
                _, stages, fingerprint = fields.join_request(request)
                version, followers, key = self.leader.join_cluster(cid, stages, fingerprint)
        return pb.JoinReply(version=version, followers=[follower_info(f) for f in followers],
                            followers_epoch=epoch,
                            heartbeat_interval_s=self.leader.cfg.membership.heartbeat_interval_s,
                            push_timeout_s=self.leader.cfg.timeouts.push_s,
                            key_id=key.key_id, key=key.key, encrypt=key.encrypt)

    @grpc_errors
    def RequestPush(self, request: pb.PushRequest, context: Any) -> pb.PushGrant:
        cid = self._cluster(context, request.cluster_id, "RequestPush")
        with self.gate.enter(f"cluster-{cid}", "RequestPush"):
            req = fields.push_request(request)
            grant = self.leader.request_push(cid, req.base_version, req.tokens,
                                             _time_left(context), req.progress, req.expected_s,
                                             cancelled=_cancelled(context))
        steps = [pb.Step(transfers=[pb.Transfer(stage=s, layer=l, follower=f) for s, l, f in step])
                 for step in grant.schedule]
        return pb.PushGrant(push_id=grant.push_id, round=grant.round,
                            server_version=grant.version, schedule=steps,
                            stage_first=grant.stage_first, ticket=grant.ticket,
                            ticket_mac=grant.ticket_mac)

    @grpc_errors
    def PushDone(self, request: pb.PushDoneRequest, context: Any) -> pb.PushVerdict:
        cid = self._cluster(context, request.cluster_id, "PushDone")
        with self.gate.enter(f"cluster-{cid}", "PushDone"):
            _, push_id, ok, error = fields.push_done_request(request)
            reply = self.leader.push_done(cid, push_id, ok, error, _time_left(context),
                                          cancelled=_cancelled(context))
        v = reply.verdict
        return pb.PushVerdict(accepted=v.accepted, has_score=v.score is not None,
                              score=v.score if v.score is not None else math.nan,
                              threshold=v.threshold if v.threshold is not None else math.nan,
                              version=v.version, round=v.round,
                              clip_factor=v.clip_factor or 0.0, reason=v.reason,
                              holdings=[pb.ChunkPos(chunk=c, position=p)
                                        for c, p in reply.holdings])

    @grpc_errors
    def PullDone(self, request: pb.PullDoneRequest, context: Any) -> pb.Ack:
        cid = self._cluster(context, request.cluster_id, "PullDone")
        with self.gate.enter(f"cluster-{cid}", "PullDone"):
            _, version = fields.pull_done_request(request)
            self.leader.pull_done(cid, version)
        return pb.Ack(ok=True)

    @grpc_errors
    def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatReply:
        cid = self._cluster(context, request.cluster_id, "Heartbeat")
        with self.gate.enter(f"cluster-{cid}", "Heartbeat"):
            _, inner_step, tokens, loss = fields.heartbeat_request(request)
            a = self.leader.heartbeat(cid, inner_step, tokens, loss)
        return pb.HeartbeatReply(version=a.version, known=a.known,
                                 followers_epoch=a.followers_epoch, finished=a.finished)

    @grpc_errors
    def LeaveCluster(self, request: pb.LeaveRequest, context: Any) -> pb.Ack:
        cid = self._cluster(context, request.cluster_id, "LeaveCluster")
        with self.gate.enter(f"cluster-{cid}", "LeaveCluster"):
            fields.leave_request(request)
            self.leader.leave(cid)
        return pb.Ack(ok=True)

    @grpc_errors
    def GetStatus(self, request: pb.StatusRequest, context: Any) -> pb.StatusReply:
        who = self._caller(context, "GetStatus")  # any member or the operator
        with self.gate.enter(who.name, "GetStatus"):
            s = self.leader.status()
        recent = getattr(self.leader, "recent_faults", None)  # (a stand-in may have none)
        return status_reply(s, self.leader.last_eval(),
                            recent(time.time()) if recent is not None else None)

    @grpc_errors
    def ReportEval(self, request: pb.EvalReport, context: Any) -> pb.EvalRecord:
        who = self._caller(context, "ReportEval")  # the operator's only (issue 15)
        heldout.require_evaluator(who)
        with self.gate.enter(who.name, "ReportEval"):
            report = fields.eval_report(request)
            return heldout.encode(self.leader.report_eval(report))

    @grpc_errors
    def Lease(self, request: pb.LeaseRequest, context: Any) -> pb.LeaseReply:
        cid = self._cluster(context, request.cluster_id, "Lease")
        with self.gate.enter(f"cluster-{cid}", "Lease"):
            _, n = fields.lease_request(request)
            holdings, windows, epoch = self.leader.lease(cid, n)
        return pb.LeaseReply(holdings=[pb.ChunkPos(chunk=c, position=p) for c, p in holdings],
                             windows_per_chunk=windows, epoch=epoch)


class FollowerServicer(pbg.FollowerServicer):
    """Serves :class:`dips.roles.follower.FollowerShard` control calls over gRPC: only to the
    leader's certificate, and only with a term ``fence`` admits (a
    :class:`dips.roles.fence.Fence`: ``check(term)`` raises Refused STALE_TERM/LEASE_HELD)."""

    def __init__(self, shard: Any, fence: Any) -> None:
        self.shard = shard
        self.fence = fence

    def _admit(self, context: Any, what: str) -> None:
        require(caller(context), "leader", what)
        raw = dict(context.invocation_metadata() or ()).get(TERM_KEY, "0")
        self.fence.check(fields.term_metadata(raw, TERM_KEY))

    @grpc_errors
    def Fence(self, request: pb.FenceRequest, context: Any) -> pb.FenceReply:
        require(caller(context), "leader", "Fence")
        version = fields.fence_request(request)
        if version < self.shard.version:  # checked before the term is taken
            raise Refused(Refusal.STALE_TERM, f"leader state at version {version} is "
                                              f"behind this follower's {self.shard.version}: a "
                                              "stale copy must not lead")
        self._admit(context, "Fence")
        return pb.FenceReply(term=self.fence.term)

    @grpc_errors
    def Score(self, request: pb.ScoreRequest, context: Any) -> pb.ScoreReply:
        self._admit(context, "Score")
        rnd, clusters, push_ids, retired = fields.score_request(request)
        norms = self.shard.score(rnd, clusters, push_ids, retired)
        return pb.ScoreReply(version=self.shard.version, norms=[
            pb.ClusterNorm(cluster_id=c, valid=v, sq_norm=g, error=e) for c, v, g, e in norms])

    @grpc_errors
    def Aggregate(self, request: pb.AggregateRequest, context: Any) -> pb.AggregateReply:
        self._admit(context, "Aggregate")
        return pb.AggregateReply(sq_norm=self.shard.aggregate(*fields.aggregate_request(request)))

    @grpc_errors
    def Apply(self, request: pb.ApplyRequest, context: Any) -> pb.ApplyReply:
        self._admit(context, "Apply")
        version, checksum = self.shard.apply(*fields.apply_request(request))
        return pb.ApplyReply(version=version, checksum=checksum)

    @grpc_errors
    def Commit(self, request: pb.CommitRequest, context: Any) -> pb.ApplyReply:
        self._admit(context, "Commit")
        version, checksum = self.shard.commit(fields.commit_request(request))
        return pb.ApplyReply(version=version, checksum=checksum)

    @grpc_errors
    def Abort(self, request: pb.DiscardRequest, context: Any) -> pb.Ack:
        self._admit(context, "Abort")
        rnd, every = fields.discard_request(request)
        self.shard.abort(None if every else rnd)
        return pb.Ack(ok=True)

    @grpc_errors
    def Restore(self, request: pb.RestoreRequest, context: Any) -> pb.ApplyReply:
        self._admit(context, "Restore")
        try:
            version, checksum = self.shard.restore(fields.restore_request(request))
        except FileNotFoundError as exc:  # neither prepared nor checkpointed on this follower
            raise Refused(Refusal.VERSION_GONE, str(exc)) from None
        return pb.ApplyReply(version=version, checksum=checksum)

    @grpc_errors
    def Discard(self, request: pb.DiscardRequest, context: Any) -> pb.Ack:
        self._admit(context, "Discard")
        self.shard.discard(fields.discard_request(request)[0])
        return pb.Ack(ok=True)

    @grpc_errors
    def GetState(self, request: pb.FollowerStateRequest, context: Any) -> pb.FollowerState:
        self._admit(context, "GetState")
        index, version, checksum = self.shard.state()
        return pb.FollowerState(index=index, version=version, checksum=checksum,
                                prepared_version=self.shard.prepared_version,
                                checkpoints=self.shard.checkpoint_versions())


class FollowerControlClient:
    """The leader's view of one follower, over gRPC (implements the leader's FollowerControl).

    Args:
        target: the follower's control address. creds: the leader's credentials.
        index: the follower's index (its certificate must say so). term: the leader's term,
            sent with every call. timeout_s: default deadline, seconds.
        on_fenced: called with a message when the follower answers STALE_TERM (a leader of a
            higher term leads it): the leader steps down.
    """

    def __init__(self, target: str, creds: Credentials, index: int, term: int,
                 timeout_s: float = 60.0,
                 on_fenced: Callable[[str], None] | None = None) -> None:
        self._c = Client(pbg.FollowerStub, target, creds, Identity.follower(index), timeout_s,
                         metadata=((TERM_KEY, str(term)),))
        self._index = index
        self._on_fenced = on_fenced
        for name in ("score", "aggregate", "apply", "commit", "abort", "restore", "discard",
                     "report", "fence"):
            setattr(self, name, self._watch(getattr(self, name)))

    def _watch(self, method: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except grpc.RpcError as exc:
                if refusal_of(exc) is Refusal.STALE_TERM and self._on_fenced is not None:
                    self._on_fenced(f"follower {self._index}: {exc.details()}")
                raise
        return call

    def fence(self, version: int = 0) -> int:
        """Take or renew this follower's lease for a leader at ``version``; returns the term
        it follows. Raises grpc.RpcError (refusal LEASE_HELD, or STALE_TERM: a higher term, or
        a follower ahead of ``version``; or unreachable)."""
        return self._c.Fence(pb.FenceRequest(version=version)).term

    def score(self, rnd: int, clusters: list[str], push_ids: list[str] | None = None,
              retired: list[str] | None = None) -> list[tuple[str, bool, float, str]]:
        reply = self._c.Score(pb.ScoreRequest(round=rnd, cluster_ids=clusters,
                                              push_ids=push_ids or [],
                                              retired_push_ids=retired or []))
        # A follower's error text may quote what a member sent it: printable, bounded.
        return [(n.cluster_id, n.valid, n.sq_norm, fields.text(n.error)) for n in reply.norms]

    def aggregate(self, rnd: int, clusters: list[str], weights: list[float]) -> float:
        return self._c.Aggregate(pb.AggregateRequest(round=rnd, cluster_ids=clusters,
                                                     weights=weights)).sq_norm

    def apply(self, rnd: int, clip: float, new_version: int, accepted: list[str],
              weights: list[float]) -> tuple[int, str]:
        r = self._c.Apply(pb.ApplyRequest(round=rnd, clip_factor=clip, new_version=new_version,
                                          accepted=accepted, weights=weights))
        return r.version, r.checksum

    def commit(self, new_version: int) -> tuple[int, str]:
        r = self._c.Commit(pb.CommitRequest(new_version=new_version))
        return r.version, r.checksum

    def abort(self, rnd: int | None) -> None:
        """Drop the prepared step and what was staged up to round ``rnd`` (None: all)."""
        self._c.Abort(pb.DiscardRequest(round=rnd or 0, all_rounds=rnd is None))

    def restore(self, version: int) -> tuple[int, str]:
        r = self._c.Restore(pb.RestoreRequest(version=version))
        return r.version, r.checksum

    def discard(self, rnd: int) -> None:
        self._c.Discard(pb.DiscardRequest(round=rnd))

    def report(self) -> tuple[int, int, list[int]]:
        r = self._c.GetState(pb.FollowerStateRequest())
        return r.version, r.prepared_version, list(r.checkpoints)

    def close(self) -> None:
        self._c.close()


def leader_client(target: str, creds: Credentials, timeout_s: float = 30.0) -> Client:
    """A :class:`Client` for the Leader service at ``target`` (``host:port`` or
    ``unix:PATH``), whose server must hold the leader's certificate."""
    return Client(pbg.LeaderStub, target, creds, Identity.leader(), timeout_s)
