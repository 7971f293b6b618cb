"""What every real-time baseline process shares: spec, data, model, pacing, logs (§4, §13).

A baseline run (:mod:`dips.baselines.real_launch`) starts one OS process per cluster; each
reads ``RUN_DIR/spec.json`` (a :class:`WorkerSpec`) and gets the same model
(:func:`dips.train.model.build_model`, same seed), tokenizer and token stream
(:mod:`dips.train.corpus`), data chunks (``assign_chunks`` over the cluster ids, the sampler
seed of ``dips launch``'s clusters) and inner AdamW (:mod:`dips.train.loop`) as Di-PS.

Emulated inner steps (§13, the issue's real-time design).  Every inner step is a REAL model
step on the cluster's batch followed by an injected delay (:class:`dips.emu.pacing.Pacer`):
calibrated (``step_s`` set: the step is padded to ``step_s × slowdown × transient`` seconds, so
16 clusters fit on 2 cores and each runs at the scenario's speed; overruns are counted) or
measured (``step_s`` None: ``(slowdown × transient − 1) ×`` the measured step, as ``dips
launch`` does).

Realistic transfers.  A transfer carries ``payload_bytes`` bytes on the wire: the real tensors
(BF16, as Di-PS sends them, §12) followed by zero padding up to ``payload_bytes``.  Choosing
``payload_bytes`` and the link rate together keeps transfer time / step time at the paper's
ratio while the trained model stays tiny.  The padding really travels (it is all-reduced or
sent point to point), so the link, not a formula, decides the transfer time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dips.config import DataConfig, InnerConfig
from dips.emu.pacing import Pacer
from dips.train.model import ModelConfig
from dips.wire.shaping import TokenBucket

__all__ = ["DIVERGED_EXIT", "ClusterRun", "SyncBuffer", "Worker", "WorkerSpec", "init_gloo", "payload_elems",
           "sampler_seed", "synced_allreduce", "worker_main"]

DIVERGED_EXIT = 3
"""Exit status of a worker whose training produced a non-finite loss (reported, not hidden)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ClusterRun(_Strict):
    """One cluster's process: identity, compute speed, network placement, link rate.

    Times are real seconds since the common start (``go.json``'s ``t0``); rates bits/s.
    ``transient``: ``(start_s, end_s, factor)`` extra slowdowns; ``rate_schedule``:
    ``(at_s, rate_bps)`` link changes.  ``addr``/``iface``: where the cluster's sockets bind
    (127.0.0.1/lo on loopback, its namespace's veth when shaped by tc).
    """

    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    slowdown: float = Field(1.0, ge=1.0)
    transient: list[tuple[float, float, float]] = Field(default_factory=list)
    rate_bps: float | None = Field(None, gt=0)
    rate_schedule: list[tuple[float, float]] = Field(default_factory=list)
    addr: str = "127.0.0.1"
    iface: str = "lo"
    port: int = Field(0, ge=0, le=65535)

    @model_validator(mode="after")
    def _valid_schedules(self) -> "ClusterRun":
        Pacer(self.slowdown, None, self.transient)  # raises ValueError naming a bad transient
        for at, rate in self.rate_schedule:
            if not (at >= 0 and rate > 0):
                raise ValueError(f"cluster {self.id!r}: rate_schedule entry {(at, rate)!r} needs "
                                 "at_s >= 0 and rate_bps > 0")
        return self

    def rate_at(self, t: float) -> float | None:
        """Link rate (bits/s) at real time ``t``; None: unshaped."""
        rate = self.rate_bps
        for at, r in sorted(self.rate_schedule):
            if at <= t:
                rate = r
        return rate


class WorkerSpec(_Strict):
    """Everything a baseline process needs (``RUN_DIR/spec.json``); validated, no extra keys.

    Units: seconds, bytes, tokens, bits/s.  ``token_budget`` counts the tokens of every inner
    step of every cluster; ``payload_bytes`` the bytes of one model-sized transfer on the wire
    (at least the model's BF16 size); ``step_s`` the real seconds of one inner step at slowdown
    1 (None: measured, see the module docstring).
    """

    method: Literal["dp", "diloco", "async-diloco"]
    seed: int = Field(0, ge=0)
    model: ModelConfig
    data: DataConfig
    inner: InnerConfig
    outer_lr: float = Field(0.7, gt=0)
    outer_momentum: float = Field(0.8, ge=0, lt=1)
    token_budget: int = Field(ge=1)
    max_time_s: float = Field(gt=0)
    step_s: float | None = Field(None, gt=0)
    payload_bytes: int = Field(0, ge=0)
    shaping: Literal["tc-tbf", "token-bucket", "none"] = "none"
    clusters: list[ClusterRun] = Field(min_length=1)
    master_addr: str = "127.0.0.1"
    master_port: int = Field(0, ge=0, le=65535)
    eval_every_tokens: int = Field(10**12, ge=1)
    eval_batches: int = Field(8, ge=1)
    eval_batch_size: int = Field(16, ge=1)
    startup_s: float = Field(300.0, gt=0)
    collective_s: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> "WorkerSpec":
        ids = [c.id for c in self.clusters]
        if len(set(ids)) != len(ids):
            raise ValueError(f"clusters: ids {ids} must be unique")
        if self.data.num_chunks < len(ids):
            raise ValueError(f"data.num_chunks = {self.data.num_chunks} < {len(ids)} clusters")
        return self

    @classmethod
    def read(cls, path: Path) -> "WorkerSpec":
        """Load and validate ``spec.json``.  Raises FileNotFoundError, pydantic.ValidationError."""
        return cls.model_validate_json(Path(path).read_text())


def sampler_seed(seed: int, cluster_id: str) -> int:
    """The BatchSampler seed of a cluster; the same formula as ``dips launch``'s clusters."""
    return seed * 7919 + zlib.crc32(cluster_id.encode())


def payload_elems(spec: WorkerSpec, n_real: int) -> int:
    """BF16 elements of one transfer: the ``n_real`` real values padded to ``payload_bytes``."""
    return max(n_real, spec.payload_bytes // 2)


class Worker:
    """One cluster's process: its data, model, inner optimizer, pacing, logs and snapshots.

    Args:
        spec: the run's spec; run_dir: the run directory; rank: index into ``spec.clusters``.

    Files: ``clusters/<id>/train.jsonl`` (one line per inner step, sync lines with
    ``"sync": true``), ``ready/<id>.json``, ``snapshots/<id>/*.safetensors`` + ``snapshots.jsonl``.
    SIGTERM/SIGINT set :attr:`stop`; the method's loop then ends at its next safe point.
    """

    def __init__(self, spec: WorkerSpec, run_dir: Path, rank: int) -> None:
        from dips.train.corpus import load_tokens
        from dips.train.loop import make_inner_optimizer
        from dips.train.model import build_model
        from dips.train.sampler import BatchSampler, assign_chunks, make_chunks

        if not 0 <= rank < len(spec.clusters):
            raise ValueError(f"rank = {rank} outside 0..{len(spec.clusters) - 1}")
        torch.set_num_threads(1)
        self.spec, self.run_dir, self.rank = spec, Path(run_dir), rank
        self.me = spec.clusters[rank]
        self.world = len(spec.clusters)
        self.stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop.set())
        d = spec.data
        data = load_tokens(d.cache_dir, d.vocab_size, d.val_fraction, d.max_train_tokens)
        chunks = make_chunks(len(data.train), d.num_chunks)
        mine = assign_chunks(d.num_chunks, [c.id for c in spec.clusters])[self.me.id]
        self.sampler = BatchSampler(data.train, chunks, mine, spec.inner.batch_size,
                                    spec.inner.seq_len, seed=sampler_seed(spec.seed, self.me.id))
        self.model = build_model(spec.model, spec.seed)
        self.opt = make_inner_optimizer(self.model, spec.inner.lr, spec.inner.weight_decay)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.params = [p for _, p in self.model.named_parameters()]
        self.n_real = sum(p.numel() for p in self.params)
        rate = self.me.rate_at(0.0)
        self.bucket = None
        if spec.shaping == "token-bucket" and rate is not None:
            self.bucket = TokenBucket(rate / 8, max(65536, rate / 8 * 0.005))
        self.t0 = math.inf
        out = self.run_dir / "clusters" / self.me.id
        out.mkdir(parents=True, exist_ok=True)
        self._log = open(out / "train.jsonl", "a", buffering=1)
        self._snap_dir = self.run_dir / "snapshots" / self.me.id
        self._next_eval = spec.eval_every_tokens
        self.pacer = Pacer(self.me.slowdown, spec.step_s, self.me.transient)

    # start barrier -------------------------------------------------------------------------
    def ready_and_wait_go(self, info: dict[str, Any] | None = None) -> dict[str, Any]:
        """Publish ``ready/<id>.json`` (with ``info``), wait for ``go.json``; returns it.

        Sets :attr:`t0` (epoch seconds, the common start).  Raises TimeoutError after
        ``spec.startup_s`` or if stopped first.
        """
        ready = self.run_dir / "ready"
        ready.mkdir(exist_ok=True)
        tmp = ready / f".{self.me.id}.tmp"
        tmp.write_text(json.dumps({"id": self.me.id, "pid": os.getpid(), **(info or {})}))
        tmp.replace(ready / f"{self.me.id}.json")
        go = self.run_dir / "go.json"
        deadline = time.monotonic() + self.spec.startup_s
        while not go.exists():
            if self.stop.is_set() or time.monotonic() > deadline:
                raise TimeoutError(f"{go} did not appear within {self.spec.startup_s} s")
            time.sleep(0.05)
        msg = json.loads(go.read_text())
        self.t0 = float(msg["t0"])
        delay = self.t0 - time.time()
        if delay > 0:
            time.sleep(delay)
        return msg

    def now(self) -> float:
        """Real seconds since the common start."""
        return time.time() - self.t0

    # pacing and shaping --------------------------------------------------------------------
    def pace(self, compute_s: float) -> float:
        """Inject this step's delay (:class:`dips.emu.pacing.Pacer`); returns the seconds waited.

        Under the token-bucket fallback it also applies the link's rate schedule.
        """
        t = self.now()
        delay = self.pacer.delay(compute_s, t)
        if self.bucket is not None:
            rate = self.me.rate_at(t)
            if rate is not None and rate / 8 != self.bucket.rate_bytes_per_s:
                self.bucket.set_rate(rate / 8)
        if delay > 0:
            self.stop.wait(delay)
        return delay

    def paced_inner_step(self, step: int, tokens_per_batch: int, grad_clip: float | None) -> None:
        """One real AdamW inner step on the next batch, paced, and recorded as ``step``
        (``tokens`` = step × tokens_per_batch) in ``train.jsonl``."""
        from dips.train.loop import inner_step

        t = time.monotonic()
        loss = inner_step(self.model, self.opt, self.sampler.next_batch(), grad_clip)
        compute_s = time.monotonic() - t
        delay_s = self.pace(compute_s)
        self.record(step=step, loss=round(loss, 5), tokens=step * tokens_per_batch,
                    compute_s=round(compute_s, 4), delay_s=round(delay_s, 4))

    @property
    def overruns(self) -> int:
        """Calibrated steps whose real compute exceeded their target duration."""
        return self.pacer.overruns

    def charge(self, nbytes: int) -> float:
        """Token-bucket fallback: wait until ``nbytes`` may leave this cluster; seconds waited."""
        return self.bucket.consume(int(nbytes)) if self.bucket is not None else 0.0

    # logs and snapshots --------------------------------------------------------------------
    def record(self, **rec: Any) -> None:
        """Append one JSON line to ``train.jsonl`` (adds ``time``: seconds since start)."""
        rec.setdefault("time", round(self.now(), 4))
        self._log.write(json.dumps(rec) + "\n")

    def maybe_snapshot(self, tensors: list[torch.Tensor], global_tokens: int, force: bool = False,
                       tag: str | None = None) -> None:
        """Save ``tensors`` (named like the model's parameters) when ``global_tokens`` crossed
        the next multiple of ``eval_every_tokens`` (or ``force``); the launcher evaluates them."""
        if not force and global_tokens < self._next_eval:
            return
        from safetensors.torch import save_file

        while self._next_eval <= global_tokens:
            self._next_eval += self.spec.eval_every_tokens
        self._snap_dir.mkdir(parents=True, exist_ok=True)
        name = tag or f"t{global_tokens:012d}"
        save_file({n: t.detach().float().contiguous() for n, t in zip(self.names, tensors)},
                  str(self._snap_dir / f"{name}.safetensors"))
        with open(self._snap_dir / "snapshots.jsonl", "a") as f:
            f.write(json.dumps({"file": f"{name}.safetensors", "time": round(self.now(), 4),
                                "tokens": int(global_tokens)}) + "\n")

    def close(self) -> None:
        """Write the final counters and close the log."""
        self.record(event="end", overruns=self.pacer.overruns)
        self._log.close()


class SyncBuffer:
    """The BF16 buffer of one all-reduce: real values, a stop flag, zero padding.

    Layout: ``[values (n_real) | flag (1) | zeros up to payload_bytes / 2]``; the padding sums
    to zero, so it stays zero after every all-reduce and only ever costs link time.
    """

    def __init__(self, n_real: int, payload_bytes: int) -> None:
        self.n_real = int(n_real)
        self.buf = torch.zeros(max(self.n_real + 1, payload_bytes // 2), dtype=torch.bfloat16)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole buffer (what the collective moves)."""
        return self.buf.numel() * self.buf.element_size()

    def pack(self, tensors: list[torch.Tensor], flag: bool) -> None:
        """Copy ``tensors`` (flattened, in order; cast to BF16) and the stop flag in."""
        offset = 0
        for t in tensors:
            n = t.numel()
            self.buf[offset:offset + n].copy_(t.detach().reshape(-1))
            offset += n
        if offset != self.n_real:
            raise ValueError(f"packed {offset} values, buffer holds {self.n_real}")
        self.buf[self.n_real] = 1.0 if flag else 0.0

    def mean_into(self, outs: list[torch.Tensor], world: int) -> None:
        """Write the all-reduced sum / ``world`` into ``outs`` (FP32, same shapes as packed)."""
        offset = 0
        for t in outs:
            n = t.numel()
            t.copy_(self.buf[offset:offset + n].view(t.shape).float() / world)
            offset += n

    @property
    def flag(self) -> bool:
        """True if any rank asked to stop (after the all-reduce)."""
        return float(self.buf[self.n_real]) > 0


def init_gloo(spec: WorkerSpec, rank: int) -> None:
    """Join the gloo group of the run (TCP rendezvous at ``master_addr:master_port``).

    The collective timeout is ``spec.collective_s``; the socket interface comes from the
    ``GLOO_SOCKET_IFNAME`` environment variable set by the launcher.
    """
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{spec.master_addr}:{spec.master_port}",
                            rank=rank, world_size=len(spec.clusters),
                            timeout=datetime.timedelta(seconds=spec.collective_s))


def synced_allreduce(worker: Worker, sbuf: SyncBuffer) -> tuple[float, float]:
    """Barrier, then all-reduce (sum) ``sbuf``; returns ``(wait_s, comm_s)``.

    ``wait_s``: time in the barrier (waiting for slower clusters); ``comm_s``: the all-reduce,
    including, under the token-bucket fallback, the time this cluster's link needs for the
    ring's ``2 (N-1) / N × nbytes`` (charged before the collective, so the slowest link delays
    everyone, as it would on the wire).
    """
    import torch.distributed as dist

    t = time.monotonic()
    dist.barrier()
    t_comm = time.monotonic()
    world = worker.world
    worker.charge(int(2 * (world - 1) / world * sbuf.nbytes))
    dist.all_reduce(sbuf.buf)
    return t_comm - t, time.monotonic() - t_comm


def worker_main(prog: str, argv: list[str] | None, body: Callable[[Worker], None]) -> None:
    """Parse ``--run-dir``/``--rank``, build the :class:`Worker`, run ``body`` and close.

    A non-finite training loss (``FloatingPointError``) is recorded as ``{"event":
    "diverged"}`` and the process exits with :data:`DIVERGED_EXIT`, so the launcher reports
    the divergence instead of a crash.
    """
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--rank", type=int, required=True)
    args = ap.parse_args(argv)
    spec = WorkerSpec.read(args.run_dir / "spec.json")
    worker = Worker(spec, args.run_dir, args.rank)
    diverged = False
    try:
        body(worker)
    except FloatingPointError as exc:
        worker.record(event="diverged", error=str(exc))
        diverged = True
    finally:
        worker.close()
    if diverged:
        sys.exit(DIVERGED_EXIT)
