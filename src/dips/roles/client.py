"""The cluster side of Di-PS as a library API for any PyTorch training loop (§3, §5, §6, §12).

Usage (see README "Use Di-PS from your own training loop")::

    client = ClusterClient(model, leader="127.0.0.1:50051", cluster_id="site-a",
                           secret=secret, H=64, stages=2)
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

Faults stay local (§12): no call blocks training for long. If the leader or a follower is
unreachable, :meth:`ClusterClient.sync` returns ``ok=False`` at once, the local model is kept,
training goes on and the sync is retried with exponential backoff (0.5 s doubling to 10 s).
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
from dataclasses import dataclass, field
from typing import Callable, Protocol

import grpc
import torch

from dips.algo import partition_contiguous
from dips.algo.refusal import Refusal
from dips.roles import failpoints
from dips.roles.cluster import StageWorker, SyncResult
from dips.roles.layers import group_layers
from dips.roles.layers import layer_of as default_layer_of
from dips.wire.pb import control_pb2 as pb
from dips.wire.control import refusal_of
from dips.wire.dataplane import DataPlaneError
from dips.wire.services import leader_client

log = logging.getLogger(__name__)


class LedgerData(Protocol):
    """A data source that follows the leader's chunk ledger (see :mod:`dips.algo.ledger`)."""

    def set_holdings(self, holdings: list[tuple[int, int]]) -> None: ...
    def merge_holdings(self, holdings: list[tuple[int, int]]) -> None: ...
    def positions(self) -> dict[int, int]: ...
    def wanted(self) -> int: ...


class ClusterClient:
    """One cluster's connection to the Di-PS leader and followers.

    Args:
        model: the cluster's model (FP32 parameters; overwritten in place on pull).
        leader: ``host:port`` of the leader's gRPC service.
        cluster_id: this cluster's id (unique in the run).
        secret: the run secret (hex string) shared by every process of the run.
        H: inner steps between two pushes (§3; default 64).
        stages: number of stage workers S pushing/pulling in parallel (threads here).
        layer_of: parameter name -> layer key (default :func:`dips.roles.layers.layer_of`).
        timeout_s: deadline of transfers and of waiting for a verdict (seconds).
        admit_timeout_s: deadline of a push request's admission into a window (seconds).
        heartbeat_interval_s: progress reports to the leader (None: the leader's value).
        data: optional ledger-aware data source (see :class:`LedgerData`).
        limiter: called with each data-plane message's byte count before sending (link
            shaping, e.g. :meth:`dips.wire.shaping.TokenBucket.consume`); shared by all stages.

    Raises:
        ValueError: H < 1, or ``stages`` not in [1, number of layers].
    """

    def __init__(self, model: torch.nn.Module, leader: str, cluster_id: str, secret: str, *,
                 H: int = 64, stages: int = 1, layer_of: Callable[[str], str] | None = None,
                 timeout_s: float = 120.0, admit_timeout_s: float = 30.0,
                 heartbeat_interval_s: float | None = None, data: LedgerData | None = None,
                 limiter: Callable[[int], object] | None = None) -> None:
        if H < 1:
            raise ValueError(f"H = {H} must be >= 1")
        layer_of = layer_of or default_layer_of
        self.model = model
        self.cluster_id = cluster_id
        self.H = H
        self.timeout_s = timeout_s
        self.admit_timeout_s = admit_timeout_s
        self.data = data
        self._limiter = limiter
        self._key = bytes.fromhex(secret)
        self._leader = leader_client(leader, secret, timeout_s=min(timeout_s, 10.0))
        self._layers = group_layers(model, layer_of)
        sizes = [sum(p.numel() * 4 for _, p in params) for _, params in self._layers]
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
        self._verdict_holdings: list[tuple[int, int]] = []
        self._retry_at = 0.0
        self._backoff_s = 0.5
        self._last_sync_step = 0
        self.version = -1
        self.inner_step = 0
        self.tokens_total = 0
        self.tokens_since_pull = 0
        self.last_loss = math.nan
        self.joins = 0

    @property
    def stage_layers(self) -> list[list[str]]:
        """Layer keys of each stage worker (contiguous, model order)."""
        return [[self._layers[i][0] for i in r] for r in self._stage_ranges]

    # ----- membership -------------------------------------------------------------------
    def join(self, attempts: int = 5) -> int:
        """Register and pull one complete model of a single version (then lease data).

        Returns the version pulled. Raises RuntimeError if no consistent pull succeeded
        within ``attempts`` tries, ``grpc.RpcError`` if the leader refuses.
        """
        last: Exception | None = None
        for _ in range(attempts):
            reply = self._leader.JoinCluster(pb.JoinRequest(
                cluster_id=self.cluster_id,
                stages=[pb.StageLayers(layers=s) for s in self.stage_layers]))
            self._connect(reply.followers)
            if self._hb_interval is None:
                self._hb_interval = reply.heartbeat_interval_s or 1.0
            try:
                self._pull(reply.version)
            except (ValueError, TimeoutError, RuntimeError) as exc:
                last = exc
                time.sleep(0.2)
                continue
            self.joins += 1
            self._rejoin.clear()
            self._pending_pull = None
            self._last_sync_step = self.inner_step
            if self.data is not None:
                self.data.set_holdings([])
                self.refill()
            self._start_heartbeat()
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
                                    self.timeout_s, limiter=self._limiter)
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
            if refusal_of(exc) is Refusal.NOT_JOINED:
                self._rejoin.set()
            return False
        self.data.merge_holdings([(h.chunk, h.position) for h in reply.holdings])
        return True

    # ----- the inner loop's hook ---------------------------------------------------------
    def step_done(self, tokens: int, loss: float | None = None) -> SyncResult | None:
        """Count one finished inner step of ``tokens`` tokens; sync when H steps have passed
        since the last sync (and any backoff has expired).

        Returns the :class:`SyncResult` when a sync was attempted, else None.
        """
        if tokens < 0:
            raise ValueError(f"tokens = {tokens} must be >= 0")
        self.inner_step += 1
        self.tokens_total += tokens
        self.tokens_since_pull += tokens
        if loss is not None:
            self.last_loss = float(loss)
        if not self.maintain():
            return None
        if self.inner_step - self._last_sync_step >= self.H and time.monotonic() >= self._retry_at:
            return self.sync()
        return None

    def maintain(self) -> bool:
        """Re-join if the leader forgot this cluster, lease chunks the data source wants.

        Returns False while a re-join is pending (then no push is attempted). Never blocks
        longer than one short RPC; failures are retried with backoff.
        """
        if time.monotonic() < self._retry_at:
            return not self._rejoin.is_set()
        if self._rejoin.is_set():
            if failpoints.link_down():
                self._fail("link down")
                return False
            try:
                self.join(attempts=1)
                self._backoff_s = 0.5
            except (grpc.RpcError, RuntimeError) as exc:
                self._fail(f"re-join failed: {exc}")
                return False
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
                if isinstance(exc, PullFailed) and Refusal.VERSION_GONE in exc.failures.refusals():
                    self._pending_pull = None  # a newer version exists: re-join to get it
                    self._rejoin.set()
                self._fail(f"pull retry failed: {exc}")
                return False
        if self.data is not None and self.data.wanted() > 0 and not self.refill():
            self._fail("lease failed")
        return True

    def _fail(self, reason: str) -> None:
        self._retry_at = time.monotonic() + self._backoff_s
        self._backoff_s = min(10.0, self._backoff_s * 2)
        log.info("cluster %s: %s; retrying in %.1f s", self.cluster_id, reason, self._backoff_s)

    def sync(self) -> SyncResult:
        """Push the local θ, wait for the outer step's verdict, pull the new global θ.

        Never raises for transport failures: returns ``SyncResult(ok=False, reason=...)``,
        keeps the local model and schedules a retry with backoff, so training goes on.
        """
        t0 = time.monotonic()
        tokens = self.tokens_since_pull
        if failpoints.link_down():
            self._fail("link down")
            return SyncResult(False, self.version, -1, tokens, ok=False, reason="link down")
        progress = [pb.ChunkPos(chunk=c, position=p) for c, p in
                    sorted(self.data.positions().items())] if self.data is not None else []
        try:
            grant = self._leader.RequestPush(pb.PushRequest(
                cluster_id=self.cluster_id, base_version=max(self.version, 0),
                tokens=max(tokens, 1), inner_steps=self.inner_step, progress=progress),
                timeout=self.admit_timeout_s)
        except grpc.RpcError as exc:
            if refusal_of(exc) is Refusal.NOT_JOINED:
                self._rejoin.set()
            reason = f"push request failed: {exc.code().name}: {exc.details()}"
            self._fail(reason)
            return SyncResult(False, self.version, -1, tokens, ok=False, reason=reason)
        failpoints.hit("push")
        error = self._run_stages(grant, max(tokens, 1))
        failpoints.hit("update")
        t1 = time.monotonic()
        try:
            v = self._leader.PushDone(pb.PushDoneRequest(
                cluster_id=self.cluster_id, push_id=grant.push_id, ok=error is None,
                error=error or ""), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            reason = f"verdict failed: {exc.code().name}: {exc.details()}"
            self._fail(reason)
            return SyncResult(False, self.version, grant.round, tokens, ok=False,
                              push_s=t1 - t0, reason=reason)
        t2 = time.monotonic()
        result = SyncResult(v.accepted, v.version, v.round, tokens,
                            score=v.score if v.has_score else None,
                            threshold=None if math.isnan(v.threshold) else v.threshold,
                            clip_factor=v.clip_factor if v.accepted else None, reason=v.reason,
                            push_s=t1 - t0, wait_s=t2 - t1)
        if self.data is not None:
            self._verdict_holdings = [(h.chunk, h.position) for h in v.holdings]
            self.data.set_holdings(self._verdict_holdings)
        # From the verdict on, T_j counts only what the ledger will count (windows after the
        # accepted positions), even if the pull below has to be retried.
        self.tokens_since_pull = 0
        self._last_sync_step = self.inner_step
        failpoints.hit("pull")
        try:
            self._pull(v.version)
            self._leader.PullDone(pb.PullDoneRequest(cluster_id=self.cluster_id,
                                                     version=v.version))
            self._backoff_s = 0.5
        except (ValueError, TimeoutError, RuntimeError, grpc.RpcError) as exc:
            result.ok = False
            result.reason += f"; pull failed: {exc}"
            self._pending_pull = v.version
            self._fail("pull failed")
            try:  # tell the leader not to wait for this pull (version -1: gave up)
                self._leader.PullDone(pb.PullDoneRequest(cluster_id=self.cluster_id, version=-1),
                                      timeout=2.0)
            except grpc.RpcError:
                pass
        result.pull_s = time.monotonic() - t2
        return result

    def _run_stages(self, grant: pb.PushGrant, tokens: int) -> str | None:
        """Push through every stage worker; returns None, or what failed (for the leader)."""
        plans: list[list[tuple[str, int]]] = [[] for _ in self._stages]
        for step in grant.schedule:
            for t in step.transfers:
                plans[t.stage].append((t.layer, t.follower))
        failures = self._guard(_in_threads(
            [lambda s=s, p=p: s.push(self.cluster_id, grant.round, grant.push_id, p, tokens)
             for s, p in zip(self._stages, plans)], self.timeout_s))
        return None if failures is None else str(failures)

    def _guard(self, failures: StageFailures | None) -> StageFailures | None:
        """After a stage worker overran its deadline, replace every stage worker: a ZeroMQ
        socket must never be used by two threads, and the stuck thread still owns its own."""
        if failures is not None and failures.overran:
            followers = [pb.FollowerInfo(index=i, data_endpoint=ep)
                         for i, ep in self._endpoints.items()]
            self._stages = []
            self._connect(followers, keep_owner=True)
        return failures

    def _pull(self, version: int) -> None:
        results: list[dict[str, torch.Tensor]] = [{} for _ in self._stages]

        def fetch(i: int, stage: StageWorker) -> None:
            results[i] = stage.pull(version, self._owner)

        failures = self._guard(_in_threads([lambda i=i, s=s: fetch(i, s)
                                            for i, s in enumerate(self._stages)], self.timeout_s))
        if failures is not None:
            raise PullFailed(version, failures)

        def load(stage: StageWorker, tensors: dict[str, torch.Tensor]) -> None:
            with torch.no_grad():
                for params in stage.layers.values():
                    for n, p in params:
                        p.copy_(tensors[n])

        # Every stage's tensors arrived and were verified: now widen BF16 into the FP32
        # parameters, one thread per stage (torch releases the GIL: the copies run in parallel).
        failures = _in_threads([lambda s=s, t=t: load(s, t) for s, t in zip(self._stages, results)],
                               self.timeout_s)
        if failures is not None:  # only a timeout or a bug can get here; the model may be partly loaded
            raise PullFailed(version, failures, loading=True)
        self.version = version
        self.tokens_since_pull = 0

    def _start_heartbeat(self) -> None:
        if self._hb_thread is not None:
            return

        def beat() -> None:
            failing = False
            while not self._hb_stop.wait(self._hb_interval):
                if failpoints.link_down():
                    failing = True
                    continue
                try:
                    reply = self._leader.Heartbeat(pb.HeartbeatRequest(
                        cluster_id=self.cluster_id, inner_step=self.inner_step,
                        tokens=self.tokens_total, last_loss=self.last_loss),
                        timeout=max(self._hb_interval, 1.0))
                    if not reply.known:
                        self._rejoin.set()
                    if failing:  # the leader is back: retry now instead of after the backoff
                        self._retry_at, self._backoff_s = 0.0, 0.5
                    failing = False
                except grpc.RpcError as exc:
                    failing = True
                    log.debug("heartbeat failed: %s", exc.code().name)

        self._hb_thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
        self._hb_thread.start()

    def close(self, leave: bool = True) -> None:
        """Stop heartbeats, optionally leave the run (chunks return to the ledger), close."""
        self._hb_stop.set()
        if self._hb_thread:
            self._hb_thread.join(5.0)
        if leave:
            try:
                self._leader.LeaveCluster(pb.LeaveRequest(cluster_id=self.cluster_id), timeout=5.0)
            except grpc.RpcError:
                pass
        for s in self._stages:
            s.close()
        self._leader.close()


@dataclass
class StageFailures:
    """What went wrong in a parallel run of the stage workers.

    ``errors``: (stage index, exception) of each stage that raised; ``overran``: some stage
    worker was still running at the deadline (its sockets must not be reused).
    """

    errors: list[tuple[int, BaseException]] = field(default_factory=list)
    overran: bool = False
    timeout_s: float = 0.0

    def refusals(self) -> set[Refusal]:
        """The refusal codes the followers answered with."""
        return {e.code for _, e in self.errors if isinstance(e, DataPlaneError)}

    def __str__(self) -> str:
        parts = [f"stage {i}: {e}" for i, e in self.errors]
        if self.overran:
            parts.append(f"stage workers still running after {self.timeout_s} s")
        return "; ".join(parts)


class PullFailed(RuntimeError):
    """A pull did not complete; ``failures`` says why (the model was not modified, except
    when ``loading`` is True: the widening into the parameters itself failed)."""

    def __init__(self, version: int, failures: StageFailures, loading: bool = False) -> None:
        super().__init__(f"{'loading' if loading else 'pull of'} version {version} failed: {failures}")
        self.version, self.failures, self.loading = version, failures, loading


def _in_threads(jobs: list[Callable[[], None]], timeout_s: float) -> StageFailures | None:
    """Run jobs in parallel threads; returns their failures, or None if all succeeded."""
    failures = StageFailures(timeout_s=timeout_s)
    lock = threading.Lock()

    def run(i: int, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception as exc:
            with lock:
                failures.errors.append((i, exc))

    threads = [threading.Thread(target=run, args=(i, j), daemon=True) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    failures.overran = any(t.is_alive() for t in threads)
    with lock:
        return failures if failures.errors or failures.overran else None
