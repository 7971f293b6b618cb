"""In-cluster collectives of a multi-rank cluster (issue 14; §5: a cluster's stage workers).

A cluster launched by torchrun has ``world`` ranks. Rank 0 alone talks to the leader; it tells
the other ranks what to do through small JSON messages broadcast on a *control group* (always
gloo on CPU, whatever the backend of the gradients: NCCL wants device tensors and a control
message is a few hundred bytes), and gathers their answers the same way. Messages are JSON
encoded to UTF-8 bytes in a uint8 tensor, never pickled (``broadcast_object_list`` would
unpickle what another process sent). Parameters travel on the *data group* (the default
process group: NCCL on GPUs, gloo on CPU) in buckets of at most ``BUCKET_BYTES``.

Every collective is bounded by its group's timeout (``init_process_group(timeout=...)``,
``new_group(timeout=...)``); a rank that dies breaks its peers' collectives at once (the TCP
connections close), so the cluster fails as a whole and torchrun (or the operator) restarts it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["BUCKET_BYTES", "Ranks", "broadcast_params"]

#: Largest flat buffer of one parameter broadcast (bytes).
BUCKET_BYTES = 64 << 20


@dataclass
class Ranks:
    """This process's place in its cluster's process group.

    Attributes:
        rank, world: global rank and world size (torchrun's RANK, WORLD_SIZE).
        control: the gloo group of control messages (None: the default group, only when the
            default group is gloo itself).
        device: where this rank's replica lives (``cuda:LOCAL_RANK`` or ``cpu``).
        timeout_s: the control group's timeout (seconds).
    """

    rank: int
    world: int
    control: Any = None
    device: torch.device = torch.device("cpu")
    timeout_s: float = 1800.0

    @property
    def lead(self) -> bool:
        """Whether this rank speaks to the leader for the cluster (rank 0)."""
        return self.rank == 0

    @classmethod
    def control_group(cls, rank: int, world: int, timeout_s: float,
                      device: torch.device) -> "Ranks":
        """A new gloo group over every rank with collectives bounded by ``timeout_s`` seconds
        (call on every rank, after ``init_process_group``)."""
        group = dist.new_group(list(range(world)), timeout=timedelta(seconds=timeout_s),
                               backend="gloo")
        return cls(rank, world, group, device, timeout_s)

    # ----- control messages (CPU, gloo) --------------------------------------------------
    def broadcast(self, msg: dict | None, src: int = 0) -> dict:
        """``msg`` (a JSON object, on rank ``src``; None elsewhere) on every rank.

        Raises RuntimeError when a peer fails or the group's timeout passes; ValueError when
        the bytes received are not a JSON object.
        """
        if self.rank == src:
            data = json.dumps(msg, separators=(",", ":")).encode()
            size = torch.tensor([len(data)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=src, group=self.control)
        if self.rank == src:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buf, src=src, group=self.control)
        return msg if self.rank == src else _decode(bytes(buf.numpy()))

    def gather(self, msg: dict) -> list[dict]:
        """Every rank's ``msg`` (a JSON object), in rank order, on every rank (all-gather)."""
        data = json.dumps(msg, separators=(",", ":")).encode()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.control)
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(bufs, mine, group=self.control)
        return [_decode(bytes(b[:int(s.item())].numpy())) for b, s in zip(bufs, sizes)]

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on some rank (all-reduce MAX on the control group)."""
        return bool(self.most(1 if flag else 0))

    def most(self, value: int) -> int:
        """The largest of every rank's ``value`` (an int32; all-reduce MAX on the control
        group)."""
        t = torch.tensor([int(value)], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return int(t.item())


def _decode(data: bytes) -> dict:
    msg = json.loads(data.decode())
    if not isinstance(msg, dict):
        raise ValueError(f"in-cluster control message is not a JSON object: {data[:80]!r}")
    return msg


def broadcast_params(params: list[torch.Tensor], src: int, group: Any = None,
                     bucket_bytes: int = BUCKET_BYTES) -> None:
    """Overwrite ``params`` on every rank with rank ``src``'s values, in place.

    ``params``: the same tensors (names, shapes, dtypes, devices) on every rank, in the same
    order. They are packed into flat buffers of at most ``bucket_bytes`` bytes (one tensor
    larger than that travels alone), one broadcast per buffer on ``group`` (None: the default
    group, whose backend matches the parameters' device). Raises RuntimeError when a peer
    fails or the group's timeout passes.
    """
    bucket: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        if not bucket:
            return
        if len(bucket) == 1:
            dist.broadcast(bucket[0].data, src=src, group=group)
        else:
            flat = torch.cat([t.detach().reshape(-1) for t in bucket])
            dist.broadcast(flat, src=src, group=group)
            with torch.no_grad():
                offset = 0
                for t in bucket:
                    n = t.numel()
                    t.copy_(flat[offset:offset + n].view_as(t))
                    offset += n
        bucket.clear()

    for p in params:
        nbytes = p.numel() * p.element_size()
        if bucket and (size + nbytes > bucket_bytes or p.dtype != bucket[0].dtype):
            flush()
            size = 0
        bucket.append(p)
        size += nbytes
    flush()
