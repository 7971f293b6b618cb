"""What every real-time baseline process shares: start barrier, pacing, shaping, logs (§4, §13).

A baseline run (:mod:`dips.baselines.real_launch`) starts one OS process per cluster; each
reads ``RUN_DIR/spec.json`` (a :class:`dips.spec.WorkerSpec`), builds its cluster with
:func:`dips.train.trainer.build_trainer` (the same model, seed, token stream, inner AdamW as
every other method; a fixed round-robin share of the chunks) and trains it with the one loop
of :func:`dips.train.run.run_loop`; each baseline module only supplies its sync.

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
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dips.algo import nesterov_step, pseudo_gradient
from dips.emu.pacing import Pacer
from dips.spec import OuterConfig, WorkerSpec
from dips.train.run import Sync, TrainLog, run_loop, stop_on_signals
from dips.train.trainer import build_trainer
from dips.wire.shaping import TokenBucket

__all__ = ["DIVERGED_EXIT", "OuterReplica", "SyncBuffer", "Worker", "WorkerSpec", "init_gloo",
           "payload_elems", "synced_allreduce", "worker_main"]

DIVERGED_EXIT = 3
"""Exit status of a worker whose training produced a non-finite loss (reported, not hidden)."""


def payload_elems(spec: WorkerSpec, n_real: int) -> int:
    """BF16 elements of one transfer: the ``n_real`` real values padded to ``payload_bytes``."""
    return max(n_real, spec.payload_bytes // 2)


class Worker:
    """One cluster's process: its trainer, pacing, link shaping, start barrier, logs, snapshots.

    Args:
        spec: the run's spec; run_dir: the run directory; rank: index into ``spec.clusters``.

    Attributes: ``trainer`` (:class:`dips.train.trainer.ClusterTrainer`: model, inner AdamW,
    fixed batches), ``names``/``params``/``n_real`` (the model's parameters), ``stop`` (set by
    SIGTERM/SIGINT; the sync's loop then ends at its next safe point), ``log``.
    Files: ``clusters/<id>/train.jsonl`` (one line per inner step, sync lines with
    ``"sync": true``), ``ready/<id>.json``, ``snapshots/<id>/*.safetensors`` + ``snapshots.jsonl``.
    """

    def __init__(self, spec: WorkerSpec, run_dir: Path, rank: int) -> None:
        if not 0 <= rank < len(spec.clusters):
            raise ValueError(f"rank = {rank} outside 0..{len(spec.clusters) - 1}")
        torch.set_num_threads(1)
        self.spec, self.run_dir, self.rank = spec, Path(run_dir), rank
        self.me = spec.clusters[rank]
        self.endpoint = spec.endpoint(self.me.id)
        self.world = len(spec.clusters)
        self.stop = stop_on_signals()
        self.trainer = build_trainer(self.me.id, spec.model, spec.data, spec.inner, spec.seed,
                                     assignment=[c.id for c in spec.clusters])
        self.model = self.trainer.model
        self.names, self.params = self.trainer.names, self.trainer.params
        self.n_real = self.trainer.n_params
        rate = self.me.link.rate_at(0.0) if self.me.link is not None else None
        self.bucket = None
        if spec.shaping == "token-bucket" and rate is not None:
            self.bucket = TokenBucket(rate / 8, max(65536, rate / 8 * 0.005))
        self.t0 = math.inf
        self.log = TrainLog(self.run_dir / "clusters" / self.me.id / "train.jsonl",
                            stamp=lambda: round(self.now(), 4))
        self._snap_dir = self.run_dir / "snapshots" / self.me.id
        self._next_eval = spec.eval_every_tokens
        self.pacer = Pacer(self.me.slowdown, spec.step_s, self.me.transient_tuples())

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
    def delay(self, compute_s: float, t: float) -> float:
        """This step's injected delay (:class:`dips.emu.pacing.Pacer`), seconds: the
        :class:`dips.train.run.Pacer` the loop takes.  Under the token-bucket fallback it also
        applies the link's rate schedule at ``t`` (seconds since the common start)."""
        delay = self.pacer.delay(compute_s, t)
        if self.bucket is not None:
            rate = self.me.link.rate_at(t) if self.me.link is not None else None
            if rate is not None and rate / 8 != self.bucket.rate_bytes_per_s:
                self.bucket.set_rate(rate / 8)
        return delay

    def train(self, sync: Sync) -> int:
        """Run the one training loop (:func:`dips.train.run.run_loop`) with ``sync``, paced by
        :meth:`delay`; returns the inner steps run."""
        return run_loop(self.trainer, sync, self.stop, self, self.log, self.now)

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
        self.log.write(rec)

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
        self.log.close()


class OuterReplica:
    """A cluster's replica of the global θ and of the Nesterov outer optimizer (§3, §4; FP32).

    The synchronous and the naive asynchronous DiLoCo keep one per cluster (no server): Δ is
    formed with :func:`dips.algo.pseudo_gradient` (θ − θ_local), the outer step is
    :func:`dips.algo.nesterov_step` (``outer.lr``, ``outer.momentum``; no clip, §4), and the
    cluster restarts from the new θ.

    Args:
        params: the cluster's model parameters (θ starts as a copy of them); outer: the settings.
    """

    def __init__(self, params: Sequence[torch.Tensor], outer: OuterConfig) -> None:
        self.theta = [p.detach().clone() for p in params]
        self.momenta = [torch.zeros_like(p) for p in self.theta]
        self.delta = [torch.zeros_like(p) for p in self.theta]
        self.outer = outer

    def pseudo_gradients(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Δ = θ − ``params`` (FP32), into the replica's own buffers (overwritten each call)."""
        for d, th, p in zip(self.delta, self.theta, params):
            pseudo_gradient(th, p, out=d)
        return self.delta

    def step(self, mean: list[torch.Tensor]) -> None:
        """One Nesterov outer step of θ with the (mean) pseudo-gradient ``mean``."""
        nesterov_step(self.theta, self.momenta, mean, self.outer.lr, self.outer.momentum)

    @torch.no_grad()
    def load_into(self, params: Sequence[torch.Tensor]) -> None:
        """Overwrite the model's ``params`` with θ (the cluster restarts from it)."""
        for p, th in zip(params, self.theta):
            p.copy_(th)


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
