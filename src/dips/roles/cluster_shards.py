"""FSDP2 stage workers in bounded memory (issue 14; §5, §10, §12 of the seed).

Under FSDP2 (``fully_shard``) every parameter is a DTensor sharded over the cluster's ranks,
and rank r is the stage worker of its block of layers (:func:`dips.roles.cluster_ranks.
rank_blocks`). A layer exists whole only inside a collective: ``full_tensor()`` (an
all-gather every rank takes part in) to push it, a broadcast from its owner to scatter it back
after a pull. So that no rank ever holds its whole block (about model ÷ ranks) beside FSDP's
own shards, the owner stages one layer at a time through :class:`LayerSlots`: ``count``
reusable host buffers (pinned when CUDA is available), each as large as the owner's largest
layer in the wire dtype. With ``count = StageWorker.depth + 1`` (3) an owner's extra host
memory is at most three of its largest layers in the wire dtype (BF16: 1.5 layers in FP32),
whatever the block's size; ``LayerSlots.allocated_bytes`` counts it.

Every rank walks the same order of the layers (:func:`interleave`: the first layer of every
rank's list, then the second of every rank's, ...), so the collectives match up while each
owner's transfer runs in its stage worker's thread, overlapped with the collectives of the
next layers:

* push (:class:`ShardedPush`): the main thread gathers each layer of the push plans in that
  order; the owner narrows it into a free slot (on the parameter's device, then one copy to
  the host) and hands it to its stage worker, which streams it to its follower and frees the
  slot once acknowledged (``StageWorker(staging=...)``);
* pull (:class:`ShardedPull`): the owner's stage worker fetches its layers one stream each
  into free slots (:meth:`dips.roles.cluster.StageWorker.pull_layer`); the main thread takes
  them in order, all ranks agree that every owner of the next step has its layer (a small
  all-reduce on the control group), and each layer is broadcast whole from its owner,
  parameter by parameter, every rank keeping its own shard. A pull that fails half way
  stops every rank at the same layer: the layers before it hold the new version (``loaded``),
  the rest the old one, and the cluster pulls again before it pushes (as after any failed
  pull, the inner steps between are trained again).
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from typing import Any, Callable

import torch

from dips.roles.cluster import host_buffer
from dips.wire.frames import DTYPES

__all__ = ["LayerSlots", "ShardedPull", "ShardedPush", "interleave", "scatter_param"]

Block = list[tuple[str, list[tuple[str, torch.nn.Parameter]]]]


def interleave(lists: list[list[str]]) -> list[tuple[int, str]]:
    """``(list index, item)`` pairs: the first item of every list in list order, then the
    second of every list, ... (the order every rank walks the layers in; module docstring)."""
    out = []
    for k in range(max((len(l) for l in lists), default=0)):
        out.extend((r, l[k]) for r, l in enumerate(lists) if k < len(l))
    return out


class LayerSlots:
    """``count`` reusable host buffers of ``capacity`` elements of ``dtype`` each (allocated on
    first use with :func:`dips.roles.cluster.host_buffer`), from which one layer's tensors
    are cut (:meth:`take`) and given back (:meth:`give`). Thread-safe.

    ``allocated_bytes``: host bytes allocated so far (the buffers are kept until the slots
    are dropped), at most ``count × capacity × itemsize``.
    """

    def __init__(self, count: int, capacity: int, dtype: torch.dtype) -> None:
        if count < 1 or capacity < 0:
            raise ValueError(f"LayerSlots: count = {count} must be >= 1, capacity = "
                             f"{capacity} >= 0")
        self.count, self.capacity, self.dtype = count, capacity, dtype
        self.allocated_bytes = 0
        self._free: list[torch.Tensor] = []
        self._made = 0
        self._cond = threading.Condition()

    def take(self, shapes: list[tuple[int, ...]], deadline: float,
             gone: Callable[[], bool]) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """A free buffer and contiguous views of it shaped ``shapes`` (their elements at most
        ``capacity``), waiting until one is free; None once ``gone()`` is true or the
        monotonic ``deadline`` (seconds) passes first. Raises ValueError if the shapes do
        not fit."""
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        if sum(sizes) > self.capacity:
            raise ValueError(f"a layer of {sum(sizes)} elements exceeds the slots' "
                             f"{self.capacity}")
        with self._cond:
            while not self._free and self._made >= self.count:
                left = deadline - time.monotonic()
                if gone() or left <= 0:
                    return None
                self._cond.wait(min(left, 0.1))
            if self._free:
                buf = self._free.pop()
            else:
                self._made += 1
                buf = host_buffer((self.capacity,), self.dtype)
                self.allocated_bytes += buf.numel() * buf.element_size()
        views, offset = [], 0
        for shape, n in zip(shapes, sizes):
            views.append(buf[offset:offset + n].view(shape))
            offset += n
        return buf, views

    @property
    def in_use(self) -> int:
        """Buffers taken and not given back."""
        with self._cond:
            return self._made - len(self._free)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer from :meth:`take`."""
        with self._cond:
            self._free.append(buf)
            self._cond.notify()


def _digest(t: torch.Tensor) -> str:
    """BLAKE2b of a host tensor's bytes (16 hex digits)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(memoryview(flat.numpy()), digest_size=8).hexdigest()


def _sync(devices: set[torch.device]) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


class ShardedPush:
    """One push of a sharded cluster: what :class:`dips.roles.cluster.StageWorker` gets as its
    ``staging`` (module docstring).

    Args:
        blocks: every rank's block (rank order) of ``(layer, [(name, DTensor parameter)])``.
        rank: this rank. plans: per rank, the layers it pushes, in its schedule order.
        slots: this rank's :class:`LayerSlots` (None when it owns no layer).
        deadline: the push's end (monotonic seconds); nobody waits past it.
    """

    def __init__(self, blocks: list[Block], rank: int, plans: list[list[str]],
                 slots: LayerSlots | None, deadline: float) -> None:
        self.params = {layer: ps for block in blocks for layer, ps in block}
        self.order = interleave(plans)
        self.rank, self.slots, self.deadline = rank, slots, deadline
        self.done = threading.Event()  # the stage worker is finished (or never started)
        self._ready: queue.Queue = queue.Queue()
        self._held: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def feed(self) -> None:
        """Main thread, every rank: gather every planned layer in :func:`interleave` order
        (``full_tensor()``, one parameter at a time); this rank's own go to its stage worker
        through a free slot. Once the stage worker is done (failed), its layers are still
        gathered, for the other ranks' sake, and dropped. Raises RuntimeError if a
        collective fails."""
        for r, layer in self.order:
            params = self.params[layer]
            slot = None
            if r == self.rank and self.slots is not None and not self.done.is_set():
                slot = self.slots.take([tuple(p.shape) for _, p in params], self.deadline,
                                       self.done.is_set)
            devices: set[torch.device] = set()
            with torch.no_grad():
                for i, (_, p) in enumerate(params):
                    whole = p.full_tensor().detach()  # type: ignore[attr-defined]
                    if slot is None:
                        continue
                    if whole.device.type == "cpu":
                        slot[1][i].copy_(whole)
                    else:  # narrowed on the device, one non-blocking copy to the host
                        slot[1][i].copy_(whole.to(slot[1][i].dtype), non_blocking=True)
                        devices.add(whole.device)
            if slot is not None:
                _sync(devices)
                with self._lock:
                    self._held[layer] = slot[0]
                self._ready.put((layer, [(n, v) for (n, _), v in zip(params, slot[1])]))

    def image(self, layer: str) -> list[tuple[str, torch.Tensor]]:
        """Stage worker thread: the next layer's image (in plan order), waiting for the main
        thread's gather. Raises TimeoutError at the deadline, RuntimeError out of order."""
        try:
            got, tensors = self._ready.get(timeout=max(0.0, self.deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"layer {layer!r} was not gathered before the push's "
                               "deadline") from None
        if got != layer:
            raise RuntimeError(f"sharded push: gathered layer {got!r}, expected {layer!r}")
        return tensors

    def release(self, layer: str) -> None:
        """Stage worker thread: ``layer`` was acknowledged (or dropped): its slot is free."""
        with self._lock:
            buf = self._held.pop(layer, None)
        if buf is not None and self.slots is not None:
            self.slots.give(buf)

    def finish(self) -> None:
        """After the stage worker returned (not while it may still run): free every slot it
        left, taken or not."""
        with self._lock:
            bufs, self._held = list(self._held.values()), {}
        if self.slots is not None:
            for buf in bufs:
                self.slots.give(buf)


def scatter_param(p: torch.Tensor, whole: torch.Tensor | None, src: int) -> None:
    """FSDP2: the DTensor parameter ``p`` takes rank ``src``'s ``whole`` value (a full-size
    tensor there, any device and dtype; None elsewhere): broadcast in ``p``'s dtype on the
    default group from ``p``'s device, then each rank copies its own shard
    (``distribute_tensor`` without communication). Raises RuntimeError if a peer fails."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    device = p.to_local().device  # type: ignore[attr-defined]
    buf = (whole.to(device=device, dtype=p.dtype) if whole is not None
           else torch.empty(tuple(p.shape), dtype=p.dtype, device=device))
    dist.broadcast(buf, src=src)
    local = distribute_tensor(buf, p.device_mesh, p.placements,  # type: ignore[attr-defined]
                              src_data_rank=None).to_local()
    with torch.no_grad():
        p.to_local().copy_(local)  # type: ignore[attr-defined]


class ShardedPull:
    """One pull of a sharded cluster (module docstring).

    Args:
        blocks: every rank's block (rank order) of ``(layer, [(name, DTensor parameter)])``.
        ranks: this rank's :class:`dips.roles.rank_comm.Ranks`.
        slots: this rank's :class:`LayerSlots` (None when it owns no layer).
        wire_dtype: "bf16" | "fp32". deadline: the pull's end (monotonic seconds).

    Attributes after :meth:`load`: ``loaded`` (layers scattered, on every rank alike),
    ``missing`` (this rank's layer that did not land in time, or None) and ``digests``
    (name -> :func:`_digest` of each pulled tensor of this rank's block, in the wire dtype,
    for :meth:`verify`).
    """

    def __init__(self, blocks: list[Block], ranks: Any, slots: LayerSlots | None,
                 wire_dtype: str, deadline: float) -> None:
        self.blocks, self.ranks, self.slots = blocks, ranks, slots
        self.dtype = DTYPES[wire_dtype]
        self.deadline = deadline
        self.gave_up = threading.Event()  # the main thread stopped loading: fetch no more
        self.loaded = 0
        self.missing: str | None = None
        self.digests: dict[str, str] = {}
        self._landed: queue.Queue = queue.Queue()
        mine = blocks[ranks.rank] if ranks.rank < len(blocks) else []
        self._mine = [layer for layer, _ in mine]

    def fetch(self, pull_layer: Callable[[str, list[tuple[str, torch.Tensor]]], None]) -> None:
        """Stage worker thread: fetch this rank's layers in block order, each into a free
        slot by ``pull_layer(layer, out)``, and hand them to :meth:`load`. Raises what
        ``pull_layer`` raises (the main thread then stops at that layer)."""
        params = dict(self.blocks[self.ranks.rank]) if self._mine else {}
        for layer in self._mine:
            assert self.slots is not None
            slot = self.slots.take([tuple(p.shape) for _, p in params[layer]], self.deadline,
                                   self.gave_up.is_set)
            if slot is None:
                return
            out = [(n, v) for (n, _), v in zip(params[layer], slot[1])]
            try:
                pull_layer(layer, out)
            except BaseException:
                self.slots.give(slot[0])
                raise
            self._landed.put((layer, slot[0], out))

    def fetched(self) -> None:
        """Stage worker side: no more layers will come (it returned, failed or never ran)."""
        self._landed.put(None)

    def finish(self) -> None:
        """After the stage worker returned (not while it may still run): free the slots of
        layers it landed after :meth:`load` stopped (another rank failed)."""
        while True:
            try:
                item = self._landed.get_nowait()
            except queue.Empty:
                return
            if item is not None and self.slots is not None:
                self.slots.give(item[1])

    def load(self) -> bool:
        """Main thread, every rank: scatter the layers in :func:`interleave` order of the
        blocks as their owners land them; returns whether every layer was loaded (the same on
        every rank). Sets ``missing`` to this rank's layer that did not land before the
        deadline. Raises RuntimeError if a collective fails."""
        steps = max((len(b) for b in self.blocks), default=0)
        ok = True
        for k in range(steps):
            item = None
            if k < len(self._mine):
                try:
                    item = self._landed.get(timeout=max(0.0, self.deadline - time.monotonic()))
                except queue.Empty:
                    self.missing = self._mine[k]
                ok = item is not None and item[0] == self._mine[k]
            if self.ranks.any(not ok):  # every owner of this step has its layer, or all stop
                ok = False
            if ok:
                for r, block in enumerate(self.blocks):
                    if k >= len(block):
                        continue
                    _, params = block[k]
                    landed = dict(item[2]) if item is not None and r == self.ranks.rank else {}
                    for n, p in params:
                        scatter_param(p, landed.get(n), r)
                        if n in landed:
                            self.digests[n] = _digest(landed[n])
                    self.loaded += 1
            if item is not None:
                self.slots.give(item[1])  # type: ignore[union-attr]
            if not ok:
                break
        self.gave_up.set()
        return ok

    def verify(self, hash_shards: Callable[[Callable[[str, torch.Tensor], Any]], dict[str, Any]]
               ) -> dict[str, str]:
        """After a complete :meth:`load`, every rank: gather every parameter whole once more,
        one at a time, through ``hash_shards(host)`` (:meth:`dips.roles.cluster_ranks.
        RankWorker._hash_shards`); each owner checks it is what it pulled. Returns the
        per-shard checksums on rank 0 ({} elsewhere). Raises RuntimeError on every rank if
        some parameter differs."""
        same = True

        def host(n: str, p: torch.Tensor) -> torch.Tensor | None:
            nonlocal same
            whole = p.full_tensor().detach().float().cpu()  # type: ignore[attr-defined]
            want = self.digests.get(n)
            if want is not None and want != _digest(whole.to(self.dtype)):
                same = False
            return whole if self.ranks.lead else None

        hashed = hash_shards(host)
        if self.ranks.any(not same):
            raise RuntimeError("after a pull, the sharded model differs from the pulled blocks")
        return {f: h.hexdigest() for f, h in hashed.items()} if self.ranks.lead else {}
