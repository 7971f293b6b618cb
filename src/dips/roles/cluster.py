"""The cluster side of Di-PS as a library API for any PyTorch training loop (§3, §5, §6, §10).

Usage (see README "Use Di-PS from your own training loop")::

    client = ClusterClient(model, leader="127.0.0.1:50051", cluster_id="site-a",
                           secret=secret, H=64, stages=2)
    client.join()                       # pulls one complete model of a single version
    for batch in data:
        loss = train_step(model, batch) # your inner AdamW step
        result = client.step_done(tokens=batch.numel(), loss=loss)
        if result is not None:          # every H inner steps: pushed, decided, pulled
            print(result.accepted, result.version)
    client.close()

A push sends this cluster's local θ (BF16) layer by layer through S stage workers, each
owning a contiguous block of layers balanced by bytes and its own ZeroMQ connections to the
followers, in the order of the leader's §10 schedule. The followers form the pseudo-gradient
Δ = θ_server − θ_local themselves, against the server's current θ (§6). After the verdict the
cluster pulls the new global θ; every tensor is fetched and checked to carry the same version
before any parameter is overwritten, so the model never mixes versions. If a sync fails
(leader unreachable, timeout) the local model is kept and training goes on; the tokens keep
counting toward the next push.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import grpc
import torch

from dips.algo import partition_contiguous
from dips.wire.dataplane import DataClient
from dips.wire.pb import control_pb2 as pb
from dips.wire.services import leader_client

log = logging.getLogger(__name__)


@dataclass
class SyncResult:
    """Outcome of one push + pull. Times in seconds; ``tokens`` = T_j of the push."""

    accepted: bool
    version: int
    round: int
    tokens: int
    score: float | None = None
    threshold: float | None = None
    clip_factor: float | None = None
    reason: str = ""
    push_s: float = 0.0
    wait_s: float = 0.0
    pull_s: float = 0.0
    ok: bool = True


def group_layers(model: torch.nn.Module, layer_of: Callable[[str], str]
                 ) -> list[tuple[str, list[tuple[str, torch.nn.Parameter]]]]:
    """Model-order layers: ``[(layer key, [(param name, parameter), ...]), ...]``.

    Raises ValueError if a layer's parameters are not contiguous in ``named_parameters``.
    """
    out: list[tuple[str, list[tuple[str, torch.nn.Parameter]]]] = []
    for name, p in model.named_parameters():
        key = layer_of(name)
        if out and out[-1][0] == key:
            out[-1][1].append((name, p))
        elif any(k == key for k, _ in out):
            raise ValueError(f"parameter {name!r}: layer {key!r} is not contiguous")
        else:
            out.append((key, [(name, p)]))
    return out


class StageWorker:
    """One stage worker: owns a contiguous block of layers and one connection per follower."""

    def __init__(self, index: int, layers: dict[str, list[tuple[str, torch.nn.Parameter]]],
                 key: bytes, endpoints: dict[int, str], timeout_s: float) -> None:
        self.index = index
        self.layers = layers
        self._clients = {f: DataClient(key, ep, timeout_s) for f, ep in endpoints.items()}

    def push(self, cluster_id: str, rnd: int, push_id: str,
             transfers: list[tuple[str, int]]) -> None:
        """Send each (layer, follower) in order as BF16. Raises on refusal or timeout."""
        for layer, follower in transfers:
            tensors = [(n, p.detach().to(torch.bfloat16)) for n, p in self.layers[layer]]
            self._clients[follower].request({"op": "push", "cluster": cluster_id, "round": rnd,
                                             "push_id": push_id, "layer": layer}, tensors)

    def pull(self, version: int, owner: dict[str, int], dtype: str = "bf16") -> dict[str, torch.Tensor]:
        """Fetch this stage's layers at ``version``; returns name -> tensor (all or raise).

        ``dtype`` is the wire dtype: "bf16" (§12, default) or "fp32" (exact export).
        """
        by_follower: dict[int, list[str]] = defaultdict(list)
        for layer in self.layers:
            by_follower[owner[layer]].append(layer)
        out: dict[str, torch.Tensor] = {}
        for f, layers in by_follower.items():
            msg = self._clients[f].request({"op": "pull", "version": version, "layers": layers,
                                            "dtype": dtype})
            if msg.header.get("version") != version:
                raise ValueError(f"follower {f} sent version {msg.header.get('version')}, "
                                 f"expected {version}")
            out.update(msg.tensors)
        for layer, params in self.layers.items():
            for n, p in params:
                if n not in out or tuple(out[n].shape) != tuple(p.shape):
                    raise ValueError(f"pull of version {version}: tensor {n!r} missing or mis-shaped")
        return out

    def close(self) -> None:
        for c in self._clients.values():
            c.close()


class ClusterClient:
    """One cluster's connection to the Di-PS leader and followers.

    Args:
        model: the cluster's model (FP32 parameters; updated in place on pull).
        leader: ``host:port`` of the leader's gRPC service.
        cluster_id: this cluster's id (unique in the run).
        secret: the run secret (hex string) shared by every process of the run.
        H: inner steps between two pushes (§3; default 64).
        stages: number of stage workers S pushing/pulling in parallel (threads here).
        layer_of: parameter name -> layer key (default :func:`dips.train.model.layer_of`).
        timeout_s: deadline of each blocking call (push admission, verdict, transfers).
        heartbeat_interval_s: progress reports to the leader (None: use the leader's value).
    """

    def __init__(self, model: torch.nn.Module, leader: str, cluster_id: str, secret: str, *,
                 H: int = 64, stages: int = 1, layer_of: Callable[[str], str] | None = None,
                 timeout_s: float = 120.0, heartbeat_interval_s: float | None = None) -> None:
        if H < 1:
            raise ValueError(f"H = {H} must be >= 1")
        if layer_of is None:
            from dips.train.model import layer_of as default_layer_of
            layer_of = default_layer_of
        self.model = model
        self.cluster_id = cluster_id
        self.H = H
        self.timeout_s = timeout_s
        self._key = bytes.fromhex(secret)
        self._leader = leader_client(leader, secret, timeout_s=min(timeout_s, 30.0))
        self._layers = group_layers(model, layer_of)
        sizes = [sum(p.numel() * 4 for _, p in params) for _, params in self._layers]
        if not 1 <= stages <= len(sizes):
            raise ValueError(f"stages = {stages} must be in [1, {len(sizes)}] (number of layers)")
        self._stage_ranges = partition_contiguous(sizes, stages)
        self._stages: list[StageWorker] = []
        self._owner: dict[str, int] = {}
        self._hb_interval = heartbeat_interval_s
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self.version = -1
        self.inner_step = 0
        self.tokens_total = 0
        self.tokens_since_pull = 0
        self.last_loss = math.nan

    @property
    def stage_layers(self) -> list[list[str]]:
        """Layer keys of each stage worker (contiguous, model order)."""
        return [[self._layers[i][0] for i in r] for r in self._stage_ranges]

    def join(self, attempts: int = 5) -> int:
        """Register with the leader and pull one complete model of a single version.

        Returns the version pulled. Raises RuntimeError if no consistent pull succeeded.
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
                self._start_heartbeat()
                return self.version
            except (ValueError, TimeoutError, RuntimeError) as exc:
                last = exc
                time.sleep(0.2)
        raise RuntimeError(f"cluster {self.cluster_id!r} could not pull a consistent model: {last}")

    def _connect(self, followers: list[pb.FollowerInfo]) -> None:
        for s in self._stages:
            s.close()
        endpoints = {f.index: f.data_endpoint for f in followers}
        self._owner = {l: f.index for f in followers for l in f.layers}
        by_key = dict(self._layers)
        self._stages = [StageWorker(i, {l: by_key[l] for l in layers}, self._key, endpoints,
                                    self.timeout_s)
                        for i, layers in enumerate(self.stage_layers)]

    def step_done(self, tokens: int, loss: float | None = None) -> SyncResult | None:
        """Count one finished inner step of ``tokens`` tokens; every H steps, :meth:`sync`.

        Returns the :class:`SyncResult` when a sync happened, else None.
        """
        if tokens < 0:
            raise ValueError(f"tokens = {tokens} must be >= 0")
        self.inner_step += 1
        self.tokens_total += tokens
        self.tokens_since_pull += tokens
        if loss is not None:
            self.last_loss = float(loss)
        if self.inner_step % self.H == 0:
            return self.sync()
        return None

    def sync(self) -> SyncResult:
        """Push the local θ, wait for the outer step's verdict, pull the new global θ.

        Never raises for transport failures: returns ``SyncResult(ok=False, reason=...)`` and
        keeps the local model, so training goes on.
        """
        t0 = time.monotonic()
        tokens = self.tokens_since_pull
        try:
            grant = self._leader.RequestPush(pb.PushRequest(
                cluster_id=self.cluster_id, base_version=self.version, tokens=max(tokens, 1),
                inner_steps=self.inner_step), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            return SyncResult(False, self.version, -1, tokens, ok=False,
                              reason=f"push request failed: {exc.code().name}: {exc.details()}")
        error = self._run_stages(lambda s, plan: s.push(self.cluster_id, grant.round,
                                                        grant.push_id, plan), grant)
        t1 = time.monotonic()
        try:
            v = self._leader.PushDone(pb.PushDoneRequest(
                cluster_id=self.cluster_id, push_id=grant.push_id, ok=error is None,
                error=error or ""), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            return SyncResult(False, self.version, grant.round, tokens, ok=False, push_s=t1 - t0,
                              reason=f"verdict failed: {exc.code().name}: {exc.details()}")
        t2 = time.monotonic()
        result = SyncResult(v.accepted, v.version, v.round, tokens,
                            score=v.score if v.has_score else None,
                            threshold=None if math.isnan(v.threshold) else v.threshold,
                            clip_factor=v.clip_factor if v.accepted else None, reason=v.reason,
                            push_s=t1 - t0, wait_s=t2 - t1)
        try:
            self._pull(v.version)
            self._leader.PullDone(pb.PullDoneRequest(cluster_id=self.cluster_id,
                                                     version=v.version))
        except (ValueError, TimeoutError, RuntimeError, grpc.RpcError) as exc:
            result.ok = False
            result.reason += f"; pull failed: {exc}"
        result.pull_s = time.monotonic() - t2
        return result

    def _run_stages(self, fn: Callable[[StageWorker, list], None], grant: pb.PushGrant) -> str | None:
        plans: list[list[tuple[str, int]]] = [[] for _ in self._stages]
        for step in grant.schedule:
            for t in step.transfers:
                plans[t.stage].append((t.layer, t.follower))
        errors: list[str] = []

        def run(stage: StageWorker, plan: list) -> None:
            try:
                fn(stage, plan)
            except Exception as exc:
                errors.append(f"stage {stage.index}: {exc}")

        threads = [threading.Thread(target=run, args=(s, p), daemon=True)
                   for s, p in zip(self._stages, plans)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout_s)
        if any(t.is_alive() for t in threads):
            errors.append(f"stage workers still running after {self.timeout_s} s")
        return "; ".join(errors) or None

    def _pull(self, version: int) -> None:
        results: list[dict[str, torch.Tensor] | None] = [None] * len(self._stages)
        errors: list[str] = []

        def run(i: int, stage: StageWorker) -> None:
            try:
                results[i] = stage.pull(version, self._owner)
            except Exception as exc:
                errors.append(f"stage {i}: {exc}")

        threads = [threading.Thread(target=run, args=(i, s), daemon=True)
                   for i, s in enumerate(self._stages)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout_s)
        if errors or any(r is None for r in results):
            raise RuntimeError(f"pull of version {version} failed: {'; '.join(errors) or 'timeout'}")
        with torch.no_grad():
            for stage, tensors in zip(self._stages, results):
                for params in stage.layers.values():
                    for n, p in params:
                        p.copy_(tensors[n])
        self.version = version
        self.tokens_since_pull = 0

    def _start_heartbeat(self) -> None:
        if self._hb_thread is not None:
            return

        def beat() -> None:
            while not self._hb_stop.wait(self._hb_interval):
                try:
                    self._leader.Heartbeat(pb.HeartbeatRequest(
                        cluster_id=self.cluster_id, inner_step=self.inner_step,
                        tokens=self.tokens_total, last_loss=self.last_loss),
                        timeout=max(self._hb_interval, 1.0))
                except grpc.RpcError as exc:
                    log.debug("heartbeat failed: %s", exc.code().name)

        self._hb_thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
        self._hb_thread.start()

    def close(self, leave: bool = True) -> None:
        """Stop heartbeats, optionally leave the run, close every connection."""
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


def fetch_global_model(model: torch.nn.Module, followers: list[pb.FollowerInfo], version: int,
                       secret: str, layer_of: Callable[[str], str] | None = None,
                       timeout_s: float = 60.0) -> None:
    """Load the global FP32 θ of ``version`` from the followers into ``model`` (eval, export).

    Uses one stage worker and does not join the run. Every tensor is fetched and checked
    before any parameter is written. Raises RuntimeError/ValueError/TimeoutError on failure.
    """
    if layer_of is None:
        from dips.train.model import layer_of as default_layer_of
        layer_of = default_layer_of
    key = bytes.fromhex(secret)
    layers = dict(group_layers(model, layer_of))
    owner = {l: f.index for f in followers for l in f.layers}
    if set(owner) != set(layers):
        raise ValueError(f"followers own layers {sorted(owner)}, model has {sorted(layers)}")
    stage = StageWorker(0, layers, key, {f.index: f.data_endpoint for f in followers}, timeout_s)
    try:
        tensors = stage.pull(version, owner, dtype="fp32")
    finally:
        stage.close()
    with torch.no_grad():
        for params in layers.values():
            for n, p in params:
                p.copy_(tensors[n])
