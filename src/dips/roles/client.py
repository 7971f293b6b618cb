"""The cluster side of Di-PS as a library API for any PyTorch training loop (§3, §5, §6, §12).

Usage (see README "Use Di-PS from your own training loop")::

    client = ClusterClient(model, leader="127.0.0.1:50051", cluster_id="site-a",
                           creds=Credentials.tls("pki/cluster-site-a"), H=64, stages=2)
    client.join()                       # pulls one complete model of a single version
    for batch in data:
        loss = train_step(model, batch) # your inner AdamW step
        result = client.step_done(tokens=batch[:, 1:].numel(), loss=loss)
        if result is not None:          # H inner steps since the last sync: pushed, pulled
            print(result.accepted, result.version)
    client.close()

A push sends the local θ (BF16) through S stage workers (:class:`dips.roles.cluster.StageWorker`)
in the order of the leader's §10 schedule; followers form Δ = θ_server − θ_local against the
server's current θ (§6). After the verdict the cluster pulls the new global θ; all tensors are
fetched and checked to carry one version before any parameter is overwritten.

Faults stay local (§12). If the leader or a follower is unreachable,
:meth:`ClusterClient.sync` returns ``ok=False`` at once, the local model is kept, training goes
on and the sync is retried with exponential backoff (0.5 s doubling to 10 s), for up to
``hold_after`` sync intervals; then, and while a verdict or a re-join is pending, the cluster
holds (:mod:`dips.roles.client_hold`, :mod:`dips.algo.hold`): ``step_done`` returns only once
it may train again, so no inner step is trained that no push could carry.
If the leader forgot this cluster (heartbeat timeout, leader restart without it), the client
re-joins: it pulls a complete model of one version and starts from freshly leased data.

With a ledger-aware data source (``data=``, e.g. :class:`dips.train.lease.LeaseSampler`)
the client leases data chunks from the leader, reports each push's window positions, and
rewinds to the accepted positions after each verdict, so a rejected or lost push's data is
trained again and no window is counted twice.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, Protocol

import grpc
import torch

from dips.algo import partition_contiguous
from dips.algo.hold import BACKOFF_FIRST_S, next_backoff
from dips.algo.refusal import Refusal, Refused
from dips.roles import failpoints
from dips.roles.client_hold import HeartbeatMixin, HoldMixin
from dips.roles.client_sync import (
    REASK_S,
    PendingVerdict,
    PullFailed,
    SyncMixin,
    TransferTimes,
)
from dips.roles.cluster import StageWorker, SyncResult
from dips.roles.layers import group_layers
from dips.wire.control import refusal_of
from dips.wire.keys import MemberKey
from dips.wire.pb import control_pb2 as pb
from dips.wire.security import Credentials
from dips.wire.services import leader_client

log = logging.getLogger(__name__)


class LedgerData(Protocol):
    """A data source that follows the leader's chunk ledger (see :mod:`dips.algo.ledger`)."""

    def set_holdings(self, holdings: list[tuple[int, int]]) -> None: ...
    def merge_holdings(self, holdings: list[tuple[int, int]]) -> None: ...
    def positions(self) -> dict[int, int]: ...
    def wanted(self) -> int: ...


#: Refusals no retry can change (a revoked or foreign certificate, a model that differs, an
#: address not the leader's): a re-join refused so raises them as :class:`.Refused`.
FINAL_REFUSALS = (Refusal.FORBIDDEN, Refusal.MODEL_MISMATCH, Refusal.NOT_LEADER)


class ClusterClient(SyncMixin, HoldMixin, HeartbeatMixin):
    """One cluster's connection to the Di-PS leader and followers.

    Args:
        model: the cluster's model (FP32 parameters; overwritten in place on pull).
        leader: ``host:port`` of the leader's gRPC service.
        cluster_id: this cluster's id (unique in the run).
        creds: this cluster's credentials (:class:`dips.wire.security.Credentials`: its TLS
            bundle, whose certificate must name ``cluster_id``, or insecure).
        H: inner steps between two pushes (§3; default 64).
        stages: number of stage workers S pushing/pulling in parallel (threads here).
        layer_of: parameter name -> layer key (default :func:`dips.roles.layers.layer_namer`
            of ``model``: its decoder blocks found in the module tree).
        timeout_s: deadline of transfers and of waiting for a verdict (seconds).
        admit_timeout_s: deadline of a push request's admission into a window (seconds).
        heartbeat_interval_s: progress reports to the leader (None: the leader's value; never
            more often than the leader's value).
        data: optional ledger-aware data source (see :class:`LedgerData`).
        limiter: called with each data-plane message's byte count before sending (link
            shaping, e.g. :meth:`dips.wire.shaping.TokenBucket.consume`); shared by all stages.
        stop: the process's stop request: once set, a transfer, an admission or a verdict
            wait in progress is given up within about 0.1 s (the push stays pending).
        fingerprint: JSON of this model's :class:`dips.spec.fingerprint.Fingerprint`, sent
            at join: the leader refuses a model that differs from the run's ("": none sent;
            a leader with a fingerprint then refuses the join).
        wire_dtype: "bf16" (§12) or "fp32", the dtype of pushes and pulls
            (``OuterConfig.wire_dtype``; the run's followers accept either).
        hold_after: sync intervals it trains past its last completed sync before it holds
            (``InnerConfig.hold_after``, :mod:`dips.algo.hold`; default 1; None: never).

    Raises:
        ValueError: H < 1, ``stages`` not in [1, number of layers], or ``hold_after`` not
            an int >= 1 or None.
    """

    def __init__(self, model: torch.nn.Module, leader: str, cluster_id: str,
                 creds: Credentials, *,
                 H: int = 64, stages: int = 1, layer_of: Callable[[str], str] | None = None,
                 timeout_s: float = 120.0, admit_timeout_s: float = 30.0,
                 heartbeat_interval_s: float | None = None, data: LedgerData | None = None,
                 limiter: Callable[[int], object] | None = None,
                 stop: threading.Event | None = None, fingerprint: str = "",
                 wire_dtype: str = "bf16", hold_after: int | None = 1) -> None:
        if H < 1:
            raise ValueError(f"H = {H} must be >= 1")
        if hold_after is not None and (isinstance(hold_after, bool)
                                       or not isinstance(hold_after, int) or hold_after < 1):
            raise ValueError(f"hold_after = {hold_after!r} must be an int >= 1 or None")
        self.hold_after = hold_after
        self.last_failure = ""  # why the last call failed (for the hold's log line)
        self.model = model
        self.cluster_id = cluster_id
        self.H = H
        self.timeout_s = timeout_s
        self.admit_timeout_s = admit_timeout_s
        self.data = data
        self._limiter = limiter
        self._key: MemberKey | None = None  # issued at each join
        self._fingerprint = fingerprint
        self._leader = leader_client(leader, creds, timeout_s=min(timeout_s, 10.0))
        self._layers = group_layers(model, layer_of)
        sizes = [sum(p.numel() * 4 for _, p in params) for _, params in self._layers]
        self.wire_dtype = wire_dtype
        self._push_bytes = sum(sizes) // (2 if wire_dtype == "bf16" else 1)  # bytes on the wire
        if not 1 <= stages <= len(sizes):
            raise ValueError(f"stages = {stages} must be in [1, {len(sizes)}] (number of layers)")
        self._stage_ranges = partition_contiguous(sizes, stages)
        self._stages: list[StageWorker] = []
        self._owner: dict[str, int] = {}
        self._endpoints: dict[int, str] = {}
        self._hb_interval = heartbeat_interval_s
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._rejoin = threading.Event()
        self._pending_pull: int | None = None
        self._pending_verdict: PendingVerdict | None = None
        self._resolved: SyncResult | None = None  # a pending verdict that arrived in maintain
        self._xfer = TransferTimes()
        self._stop = stop or threading.Event()
        self._followers_epoch: int | None = None  # from heartbeats (HeartbeatReply)
        self._leader_push_timeout_s = 0.0
        self._verdict_holdings: list[tuple[int, int]] = []
        self._retry_at = 0.0
        self._backoff_s = BACKOFF_FIRST_S
        self._last_sync_step = 0
        self.version = -1
        self.accepted_version: int | None = None  # the version its last accepted push made
        self.leader_version = -1  # the global version in the leader's last heartbeat reply
        self.inner_step = self.tokens_total = self.tokens_since_pull = 0
        self.last_loss = math.nan
        self.joins = 0
        #: Called on a re-join of this process (its train.jsonl record) with the version pulled.
        self.on_rejoin: Callable[[int], object] | None = None
        self.finished = ""  # why the run ended, once the leader says so: the loop stops

    def sync_due_after_step(self) -> bool:
        """Whether the next :meth:`step_done` reaches H inner steps since the last sync, so
        that it syncs unless a backoff or the leader's state defers it (the training loop
        records the step before that sync: :func:`dips.train.run.run_loop`)."""
        return self.inner_step + 1 - self._last_sync_step >= self.H

    @property
    def stage_layers(self) -> list[list[str]]:
        """Layer keys of each stage worker (contiguous, model order)."""
        return [[self._layers[i][0] for i in r] for r in self._stage_ranges]

    def count_from(self, steps: int, tokens: int) -> None:
        """Count on from a saved inner step and token count (a process that resumed its
        cluster's inner state, issue 14): the heartbeats then report the cluster's own step
        numbering and tokens across its processes, as its ``train.jsonl`` numbers them, not
        this process's (review 28 of issue 15, #2). Call before :meth:`join`. Raises
        ValueError for a negative ``steps`` or ``tokens``."""
        if steps < 0 or tokens < 0:
            raise ValueError(f"steps = {steps}, tokens = {tokens}: must be >= 0")
        self.inner_step = self._last_sync_step = int(steps)
        self.tokens_total = int(tokens)

    # ----- membership -------------------------------------------------------------------
    def join(self, attempts: int = 5) -> int:
        """Register and pull one complete model of a single version (then lease data).
        Heartbeats start once the leader took the join, before the pull; a join that fails
        stops the heartbeats it started.

        Returns the version pulled. Raises RuntimeError if no consistent pull succeeded
        within ``attempts`` tries, ``grpc.RpcError`` if the leader refuses.
        """
        beating = self._hb_thread is not None
        try:
            return self._join(attempts)
        except BaseException:
            if not beating:  # a failed first join leaves no member beating
                self._stop_heartbeat()
            raise

    def _join(self, attempts: int) -> int:
        last: Exception | None = None
        for _ in range(attempts):
            reply = self._leader.JoinCluster(pb.JoinRequest(
                cluster_id=self.cluster_id,
                stages=[pb.StageLayers(layers=s) for s in self.stage_layers],
                fingerprint=self._fingerprint))
            self._key = MemberKey(reply.key_id, reply.key, reply.encrypt)
            self._connect(reply.followers)
            self._leader_push_timeout_s = reply.push_timeout_s
            if reply.followers_epoch > 0:  # the join's pull is given up once a follower goes
                self._followers_epoch = reply.followers_epoch  # down or comes back (review 28)
            # Never faster than the leader's interval: it refuses a member's heartbeats beyond
            # a few per interval of its own (dips.algo.ratelimit.heartbeat_limit).
            self._hb_interval = max(self._hb_interval or 0.0, reply.heartbeat_interval_s or 1.0)
            # A member from here on: beat while the pull (a large model, a follower down) and
            # the caller's resume take their time, or the leader removes it (review 26, M6).
            self._start_heartbeat()
            if reply.version < (self.accepted_version or -1):  # undone by a rollback (§12)
                log.warning("cluster %s: its push accepted into version %d was undone: the run "
                            "rolled back to version %d; its windows are trained again",
                            self.cluster_id, self.accepted_version, reply.version)
            self.accepted_version = None  # in the version joined, or undone
            try:
                self._pull(reply.version)
            except (ValueError, TimeoutError, RuntimeError) as exc:
                last = exc
                time.sleep(0.2)
                continue
            self.joins += 1
            self._rejoin.clear()
            self._pending_pull = self._pending_verdict = None
            self._last_sync_step = self.inner_step
            if self.data is not None:
                self.data.set_holdings([])
                self.refill()
            if self.joins > 1 and self.on_rejoin is not None:
                self.on_rejoin(self.version)
            return self.version
        raise RuntimeError(f"cluster {self.cluster_id!r} could not pull a consistent model: {last}")

    def _connect(self, followers: list[pb.FollowerInfo], keep_owner: bool = False) -> None:
        for s in self._stages:
            s.close()
        endpoints = {f.index: f.data_endpoint for f in followers}
        self._endpoints = endpoints
        if not keep_owner:
            self._owner = {l: f.index for f in followers for l in f.layers}
        by_key = dict(self._layers)
        self._stages = [StageWorker(i, {l: by_key[l] for l in layers}, self._key, endpoints,
                                    self.timeout_s, limiter=self._limiter, dtype=self.wire_dtype)
                        for i, layers in enumerate(self.stage_layers)]

    def refill(self) -> bool:
        """Lease as many chunks as the data source wants; False if the leader is unreachable."""
        if self.data is None:
            return True
        if failpoints.link_down():
            return False
        try:
            reply = self._leader.Lease(pb.LeaseRequest(cluster_id=self.cluster_id,
                                                       n=self.data.wanted()), timeout=5.0)
        except grpc.RpcError as exc:
            if refusal_of(exc) in (Refusal.NOT_JOINED, Refusal.FORBIDDEN):
                self._rejoin.set()  # forgotten, or revoked: the re-join tells which
            return False
        self.data.merge_holdings([(h.chunk, h.position) for h in reply.holdings])
        return True

    # ----- the inner loop's hook ---------------------------------------------------------
    def step_done(self, tokens: int, loss: float | None = None,
                  wait: bool = True) -> SyncResult | None:
        """Count one finished inner step of ``tokens`` tokens; sync when H steps have passed
        since the last sync (and any backoff has expired). With ``wait`` (default), then hold
        while it must (:meth:`wait_while_held`: the leader unreachable for ``hold_after``
        sync intervals, a verdict or a re-join pending), so the next inner step is one a push
        can carry; ``wait=False``: return at once (the caller runs :meth:`hold_tick` itself).

        Returns the :class:`SyncResult` of the last sync attempted, else None.
        """
        if tokens < 0:
            raise ValueError(f"tokens = {tokens} must be >= 0")
        self.inner_step += 1
        self.tokens_total += tokens
        self.tokens_since_pull += tokens
        if loss is not None:
            self.last_loss = float(loss)
        res = self._try_sync(idle_failpoint=True)
        if wait:
            res = self.wait_while_held() or res
        return res

    def retry(self) -> SyncResult | None:
        """One try of a held cluster (:mod:`dips.roles.client_hold`): what :meth:`maintain`
        does, then the sync if one is due and the backoff allows, counting no inner step.
        Returns the result of a sync attempted or of a verdict that arrived, else None."""
        return self._try_sync(idle_failpoint=False)

    def _try_sync(self, idle_failpoint: bool) -> SyncResult | None:
        ready = self.maintain()
        if self._resolved is not None:  # a verdict asked again has arrived: report it
            res, self._resolved = self._resolved, None
            return res
        if not ready:
            return None
        if self.inner_step - self._last_sync_step >= self.H and time.monotonic() >= self._retry_at:
            return self.sync()
        if idle_failpoint:
            failpoints.hit("idle")  # fault injection: between syncs
        return None

    def flush(self) -> SyncResult | None:
        """Push what was trained since the last sync now, even if fewer than H inner steps
        (the data ran out: the chunks can only finish, and a new epoch begin, once these
        windows are accepted). Returns the result, or None if there is nothing to push."""
        if (self.inner_step == self._last_sync_step or self._pending_verdict is not None
                or not self.maintain() or time.monotonic() < self._retry_at):
            return None
        return self.sync()

    def maintain(self) -> bool:
        """Re-join if the leader forgot this cluster, ask again for a pending verdict, retry a
        pending pull, lease chunks the data source wants.

        Returns False while a re-join or a verdict is pending (then no push is attempted).
        Never blocks longer than one short RPC; failures are retried with backoff.
        """
        if time.monotonic() < self._retry_at:
            return not self._rejoin.is_set() and self._pending_verdict is None
        if self._rejoin.is_set():
            if failpoints.link_down():
                self._fail("link down")
                return False
            try:
                self.join(attempts=1)
                self._backoff_s = BACKOFF_FIRST_S
            except (grpc.RpcError, RuntimeError) as exc:
                if isinstance(exc, grpc.RpcError) and refusal_of(exc) is Refusal.RUN_FINISHED:
                    self.finished = exc.details() or "run finished"
                    return False
                if isinstance(exc, grpc.RpcError) and refusal_of(exc) in FINAL_REFUSALS:
                    raise Refused(refusal_of(exc), f"cluster {self.cluster_id!r}: the leader "
                                                   f"refuses it for good: {exc.details()}") from None
                self._fail(f"re-join failed: {exc}")
                return False
        if self._pending_verdict is not None:
            res = self.resolve(self._pending_verdict, REASK_S)
            if self._pending_verdict is not None or self._rejoin.is_set():
                return False
            self._resolved = res
            return True
        if self._pending_pull is not None:
            try:
                self._pull(self._pending_pull)
                # The pulled model does not contain what was trained since the verdict: train
                # those windows again (the ledger never counted them).
                if self.data is not None:
                    self.data.set_holdings(self._verdict_holdings)
                self._leader.PullDone(pb.PullDoneRequest(cluster_id=self.cluster_id,
                                                         version=self._pending_pull), timeout=2.0)
                self._pending_pull = None
            except (ValueError, TimeoutError, RuntimeError, grpc.RpcError) as exc:
                if isinstance(exc, PullFailed) and exc.failures.refusals() & {
                        Refusal.VERSION_GONE, Refusal.NOT_JOINED}:
                    self._pending_pull = None  # a newer version exists: re-join to get it
                    self._rejoin.set()
                self._fail(f"pull retry failed: {exc}")
                return False
        if self.data is not None and self.data.wanted() > 0 and not self.refill():
            self._fail("lease failed")
        return True

    def _fail(self, reason: str) -> None:
        self.last_failure = reason
        wait_s = self._backoff_s
        self._retry_at = time.monotonic() + wait_s
        self._backoff_s = next_backoff(wait_s)  # dips.algo.hold: 0.5 s doubling to 10 s
        log.info("cluster %s: %s; retrying in %.1f s", self.cluster_id, reason, wait_s)

    def close(self, leave: bool = True) -> None:
        """Stop heartbeats, optionally leave the run (chunks return to the ledger), close."""
        self._stop_heartbeat()
        if leave:
            try:
                self._leader.LeaveCluster(pb.LeaveRequest(cluster_id=self.cluster_id), timeout=5.0)
            except grpc.RpcError:
                pass
        for s in self._stages:
            s.close()
        self._leader.close()
