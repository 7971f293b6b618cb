"""Stage workers: the data-plane side of a cluster (§5, §10, §12 of the seed).

A :class:`StageWorker` owns a contiguous block of layers and one ZeroMQ connection per
follower; it pushes its layers as BF16 (or FP32) in the order of the leader's §10 schedule and pulls
them back, checking that every tensor carries the requested version. Parameters may live
on a GPU: a push narrows each one to the wire dtype on its device and copies it, without
blocking, into pinned host buffers (:func:`host_buffer`); a pull lands in those buffers and
each tensor goes back to its parameter's device before it is widened there
(:class:`DeviceLanding`). The cluster's control
logic (join, sync, heartbeats, backoff, data leases) is :class:`dips.roles.client.ClusterClient`;
:func:`fetch_global_model` reads the global model for evaluation and export.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dips.roles import failpoints
from dips.roles.layers import group_layers
from dips.wire.dataplane import DataClient
from dips.wire.keys import MemberKey
from dips.wire.pb import control_pb2 as pb
from dips.wire.frames import DTYPES
from dips.wire.seal import TAG_BYTES
from dips.wire.serving import SINGLE_REPLY_BYTES
from dips.wire.stream import DEFAULT_CHUNK_BYTES


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor of ``shape`` and ``dtype``: page-locked (pinned) when CUDA
    is available, so device copies into and out of it run as DMA without blocking the host
    (the torch ``pin_memory`` allocator); plain host memory otherwise."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


class DeviceLanding(Mapping):
    """A pull's tensors (name -> host tensor in the wire dtype) as each parameter's device
    sees them: reading ``landing[name]`` copies that tensor to ``devices[name]`` (still in the
    wire dtype, one tensor at a time, so at most one extra tensor lives on the device) and
    ``param.copy_(landing[name])`` then widens it on the device; a host parameter gets the
    host tensor itself. The host tensors stay valid until the stage worker's next push or
    pull (its reused buffers)."""

    def __init__(self, host: dict[str, torch.Tensor], devices: dict[str, torch.device]) -> None:
        self.host, self.devices = host, devices

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.host[name]
        device = self.devices.get(name)
        if device is None or device.type == "cpu":
            return t
        # Blocking: the host buffer is rewritten by the next pull from the socket.
        return t.to(device)

    def __iter__(self) -> Iterator[str]:
        return iter(self.host)

    def __len__(self) -> int:
        return len(self.host)


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


class _Links:
    """One lock per (push, follower), shared by the stage workers of this process (§10).

    The leader's schedule orders each worker's transfers so that the workers of a step use
    distinct followers; holding the follower's lock while sending to it keeps two workers of
    one cluster from ever sending to the same follower at once (endpoint contention) when one
    runs ahead of the schedule, without a barrier per step that would idle every link until
    the slowest transfer of the step is done. A worker blocks on a lock only while it holds
    none (it first finishes its transfers in flight), so workers cannot deadlock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._locks: dict[tuple[str, int], list] = {}

    def acquire(self, push_id: str, follower: int, timeout_s: float | None) -> bool:
        """Take the link; ``timeout_s`` None: only if free now. Returns whether taken."""
        with self._lock:
            entry = self._locks.setdefault((push_id, follower), [threading.Lock(), 0])
            entry[1] += 1
        ok = entry[0].acquire(timeout=timeout_s) if timeout_s is not None else entry[0].acquire(False)
        if not ok:
            self._unref(push_id, follower, entry)
        return ok

    def release(self, push_id: str, follower: int) -> None:
        with self._lock:
            entry = self._locks[(push_id, follower)]
        entry[0].release()
        self._unref(push_id, follower, entry)

    def _unref(self, push_id: str, follower: int, entry: list) -> None:
        with self._lock:
            entry[1] -= 1
            if not entry[1]:
                del self._locks[(push_id, follower)]


_LINKS = _Links()


class StageWorker:
    """One stage worker: owns a contiguous block of layers and one connection per follower.

    Pushes and pulls stream each layer in chunks (``mode = "stream"``, §10): the layer's image
    in the wire dtype (BF16, §12; or FP32, ``OuterConfig.wire_dtype``) is written into buffers
    owned by the worker and reused by every push and pull (no
    fresh memory per round), the next layer is converted while libzmq sends the current one,
    and a pull lands in those buffers straight from the socket. ``mode = "single"`` is the
    unpipelined path (one message per layer, fresh tensors; a pull of more than one message
    carries from a follower is streamed all the same), kept for benchmarks and the test that
    both leave the followers bit-identical.

    Args:
        index: stage index. layers: ``{layer key: [(param name, parameter), ...]}``.
        key: the cluster's data-plane key (:class:`dips.wire.keys.MemberKey`, from its join).
        endpoints: follower index -> ``tcp://host:port``.
        timeout_s: deadline of each data-plane reply.
        limiter: called with each message's byte count before it is sent (link shaping).
        dtype: the wire dtype of pushes and pulls, "bf16" (§12) or "fp32".
        staging: where a push gets each layer's image instead of the worker's own buffers
            (``mode = "stream"`` only): ``staging.image(layer)`` returns ``[(name, host
            tensor in the wire dtype)]`` and ``staging.release(layer)`` is called once that
            layer's follower acknowledged it (or the push failed), after which the tensors
            may be reused (:class:`dips.roles.cluster_shards.ShardedPush`: FSDP2 layers
            gathered one at a time into a bounded set of buffers). None: the worker's own
            reused buffers, one per parameter.
    """

    mode = "stream"
    chunk_bytes = DEFAULT_CHUNK_BYTES
    depth = 2

    def __init__(self, index: int, layers: dict[str, list[tuple[str, torch.nn.Parameter]]],
                 key: MemberKey, endpoints: dict[int, str], timeout_s: float,
                 limiter: Callable[[int], Any] | None = None, dtype: str = "bf16",
                 staging: Any = None) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"wire dtype = {dtype!r} not one of {sorted(DTYPES)}")
        self.index = index
        self.staging = staging
        self.dtype = dtype
        self.layers = layers
        self.timeout_s = timeout_s
        # Whole tensors arrive only in single-message pulls: the largest in FP32 (export).
        largest = max((p.numel() * 4 for ps in layers.values() for _, p in ps), default=0)
        self._clients = {f: DataClient(key, ep, timeout_s, limiter,
                                       max_message_bytes=largest + TAG_BYTES)
                         for f, ep in endpoints.items()}
        self._wire: dict[str, torch.Tensor] = {}
        self.acked_bytes = 0  # of the current or last push, confirmed by followers
        #: the follower whose reply (or busy link) the current transfer waits for, None
        #: between transfers: what a transfer that overran its deadline was stuck on
        self.waiting_on: int | None = None

    def set_timeout(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` seconds for each reply (and a busy link) from now on."""
        self.timeout_s = timeout_s
        for c in self._clients.values():
            c.set_timeout(timeout_s)

    def _buffer(self, name: str, p: torch.Tensor) -> torch.Tensor:
        buf = self._wire.get(name)
        if buf is None:  # touched once, then reused by every push and pull
            buf = self._wire[name] = host_buffer(tuple(p.shape), DTYPES[self.dtype])
        return buf

    def _image(self, layer: str) -> list[tuple[str, torch.Tensor]]:
        """This layer's parameters in the wire dtype, in the worker's reused host buffers.

        A device parameter is narrowed on its device, copied into its pinned buffer without
        blocking, and the device's stream is waited for once per layer, before the buffers
        are handed to the socket."""
        out, devices = [], set()
        with torch.no_grad():
            for n, p in self.layers[layer]:
                src, buf = p.detach(), self._buffer(n, p)
                if src.device.type == "cpu":
                    buf.copy_(src)
                else:
                    buf.copy_(src.to(buf.dtype), non_blocking=True)
                    devices.add(src.device)
                out.append((n, buf))
        for device in devices:
            torch.cuda.current_stream(device).synchronize()
        return out

    def _devices(self, names: Any) -> dict[str, torch.device]:
        """Where each parameter of ``names`` lives (a pull lands there)."""
        wanted = set(names)
        return {n: p.device for ps in self.layers.values() for n, p in ps if n in wanted}

    def push(self, cluster_id: str, rnd: int, push_id: str, transfers: list[tuple],
             tokens: int | None = None, stage: bool = False,
             ticket: tuple[str, bytes] | None = None) -> None:
        """Send each ``(layer, follower, ...)`` in schedule order in the wire dtype. Raises on refusal
        (DataPlaneError naming the reason) or timeout.

        ``tokens`` (T_j, as announced to the leader) travels in each layer's header so that
        followers can form the round's token-weighted sum at receipt
        (:mod:`dips.roles.round_sum`); without it they form δ when the leader asks.
        ``stage``: the push is sent ahead of any round (the leader's ``stage_first``); the
        followers keep it by push id until a round takes it. ``acked_bytes`` counts the bytes
        followers confirmed, for the cluster's estimate of its link when a push fails.
        ``ticket``: the grant's admission ticket ``(JSON, MAC)`` (:mod:`dips.wire.admission`),
        copied into every header; a follower stages nothing without it.

        Up to ``depth`` layers are in flight: layer k+1 is converted, and queued if its link is
        free, while layer k is on the wire, so neither the link nor the follower's consumer
        waits for a round trip between layers.
        """
        head = {"op": "push", "cluster": cluster_id, "round": rnd, "push_id": push_id,
                "tokens": tokens}
        if stage:
            head["stage"] = True
        if ticket is not None:
            head["ticket"], head["ticket_mac"] = ticket[0], bytes(ticket[1]).hex()
        self.acked_bytes = 0
        if self.mode == "single":
            for layer, follower, *_ in transfers:
                tensors = [(n, p.detach().to(DTYPES[self.dtype]).cpu())
                           for n, p in self.layers[layer]]
                self.waiting_on = follower
                self._clients[follower].request({**head, "layer": layer}, tensors)
            self.waiting_on = None
            return
        flight: deque[tuple[int, Any, int, str]] = deque()
        held: set[int] = set()
        image = self.staging.image if self.staging is not None else self._image
        staged: list[str] = []  # layers whose image is held (staging: released once acked)

        def release(layer: str) -> None:
            staged.remove(layer)
            if self.staging is not None:
                self.staging.release(layer)

        def finish_oldest() -> None:
            f, pending, nbytes, layer = flight.popleft()
            self.waiting_on = f
            self._clients[f].push_finish(pending)
            self.acked_bytes += nbytes
            release(layer)
            failpoints.hit("push")  # fault injection: in the middle of a push
            if all(g != f for g, *_ in flight):
                held.discard(f)
                _LINKS.release(push_id, f)

        def next_image(layer: str) -> list[tuple[str, torch.Tensor]]:
            out = image(layer)
            staged.append(layer)
            return out

        try:
            ready = next_image(transfers[0][0]) if transfers else []
            for k, (layer, f, *_) in enumerate(transfers):
                self.waiting_on = f
                if f not in held and not _LINKS.acquire(push_id, f, None):
                    while flight:  # hold nothing while waiting for a busy link
                        finish_oldest()
                    if not _LINKS.acquire(push_id, f, self.timeout_s):
                        raise TimeoutError(f"link to follower {f} busy for {self.timeout_s} s")
                held.add(f)
                flight.append((f, self._clients[f].push_start({**head, "layer": layer}, ready,
                                                              self.chunk_bytes),
                               sum(t.numel() * t.element_size() for _, t in ready), layer))
                if k + 1 < len(transfers):  # overlaps libzmq sending layer k (§10)
                    ready = next_image(transfers[k + 1][0])
                while len(flight) >= self.depth:
                    finish_oldest()
            while flight:
                finish_oldest()
            self.waiting_on = None
        except BaseException:
            for f, *_ in flight:
                self._clients[f].close()  # drop the unread replies of abandoned streams
            for f in held:
                _LINKS.release(push_id, f)
            for layer in list(staged):  # the closed sockets no longer read them
                release(layer)
            raise

    def _single_fits(self, layers: list[str], dtype: str) -> bool:
        """Whether one message may carry ``layers`` in ``dtype`` (a follower answers at most
        :data:`~dips.wire.serving.SINGLE_REPLY_BYTES` in one; more is pulled as a stream)."""
        size = sum(p.numel() * DTYPES[dtype].itemsize for l in layers for _, p in self.layers[l])
        return size <= SINGLE_REPLY_BYTES

    def pull(self, version: int, owner: dict[str, int],
             dtype: str | None = None) -> Mapping[str, torch.Tensor]:
        """Fetch this stage's layers at ``version``; returns name -> tensor (all or raise),
        a :class:`DeviceLanding`: each tensor read from it is on its parameter's device.

        ``dtype`` is the wire dtype: None, the worker's own (the host tensors are its
        reused buffers, valid until its next push or pull), or "fp32" (exact export).
        """
        dtype = dtype or self.dtype
        by_follower: dict[int, list[str]] = defaultdict(list)
        for layer in self.layers:
            by_follower[owner[layer]].append(layer)
        out: dict[str, torch.Tensor] = {}
        for f, layers in by_follower.items():
            self.waiting_on = f
            head = {"op": "pull", "version": version, "layers": layers, "dtype": dtype}
            if self.mode == "single" and self._single_fits(layers, dtype):
                msg = self._clients[f].request(head)
                got, tensors = msg.header.get("version"), msg.tensors
            else:
                params = [(n, p) for l in layers for n, p in self.layers[l]]
                if dtype == self.dtype:
                    tensors = {n: self._buffer(n, p) for n, p in params}
                else:
                    tensors = {n: host_buffer(tuple(p.shape), torch.float32) for n, p in params}
                got = self._clients[f].pull(head, list(tensors.items()), self.chunk_bytes).get("version")
            if got != version:
                raise ValueError(f"follower {f} sent version {got}, expected {version}")
            out.update(tensors)
        self.waiting_on = None
        for layer, params in self.layers.items():
            for n, p in params:
                if n not in out or tuple(out[n].shape) != tuple(p.shape):
                    raise ValueError(f"pull of version {version}: tensor {n!r} missing or mis-shaped")
        return DeviceLanding(out, self._devices(out))

    def pull_layer(self, version: int, layer: str, follower: int,
                   out: list[tuple[str, torch.Tensor]]) -> None:
        """Fetch one ``layer`` of ``version`` from ``follower`` (one stream) into ``out``:
        ``[(name, contiguous host tensor)]`` of the layer's parameters in the worker's wire
        dtype, in the layer's order, which hold partial data if it raises (a staging area).
        Raises as :meth:`dips.wire.dataclient.DataClient.pull`, and ValueError if the
        follower sent another version."""
        head = {"op": "pull", "version": version, "layers": [layer], "dtype": self.dtype}
        self.waiting_on = follower
        got = self._clients[follower].pull(head, out, self.chunk_bytes).get("version")
        self.waiting_on = None
        if got != version:
            raise ValueError(f"follower {follower} sent version {got}, expected {version}")

    def close(self) -> None:
        for c in self._clients.values():
            c.close()


def fetch_global_model(model: torch.nn.Module, followers: list[pb.FollowerInfo], version: int,
                       key: MemberKey, layer_of: Callable[[str], str] | None = None,
                       timeout_s: float = 60.0) -> None:
    """Load the global FP32 θ of ``version`` from the followers into ``model`` (eval, export).

    Uses one stage worker and does not join the run (``key``: an observer's data-plane key, as
    ``dips export`` holds; a cluster's key pulls FP32 only in a run with ``outer.wire_dtype:
    fp32``, else the followers refuse it FORBIDDEN). Every tensor is fetched and checked before
    any parameter is written. Raises RuntimeError/ValueError/TimeoutError on failure.
    """
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
