"""Real-time cross-cluster data parallel: a gradient all-reduce every inner step (§3, §4).

One process per cluster (``python -m dips.baselines.real_dp --run-dir D --rank i``, started by
:mod:`dips.baselines.real_launch`).  Every inner step each cluster computes the gradient of its
own batch, waits for the others (barrier), all-reduces the gradients with ``torch.distributed``
(gloo, over TCP) in BF16 padded to ``payload_bytes`` (the wire size of a model-sized
transfer), averages, clips (global L2 norm ``inner.grad_clip``) and takes one AdamW step.  All
replicas stay identical, so the WAN sits on every step's critical path: the slowest cluster
and the slowest link set the pace of everyone (§4).

Stops after ``ceil(token_budget / (N × tokens per step))`` steps, or earlier when any rank
was signalled or passed ``max_time_s`` (a flag inside the all-reduce, so all ranks stop on
the same step).  Rank 0 saves snapshots of the model for the launcher's evaluation.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import torch

from dips.baselines.real_common import SyncBuffer, Worker, init_gloo, synced_allreduce, worker_main
from dips.train.trainer import ClusterTrainer, StepResult

__all__ = ["GradientAllReduce", "main", "run"]


class GradientAllReduce:
    """Per-step data parallel as the sync of :func:`dips.train.run.run_loop` (module docstring).

    The gradient hook all-reduces every inner step's gradient (after the step's injected
    delay, before the clip and the AdamW step); the step's record gets ``global_tokens``,
    ``sync``, ``wait_s``, ``comm_s`` and ``bytes``.  Rank 0 saves a snapshot every
    ``eval_every_tokens`` global tokens and at the end.

    Args:
        worker: this cluster's process.
    """

    def __init__(self, worker: Worker) -> None:
        self.w = worker
        self.tpb = worker.trainer.tokens_per_batch
        self.steps = math.ceil(worker.spec.token_budget / (worker.world * self.tpb))
        self.sbuf = SyncBuffer(worker.n_real, worker.spec.payload_bytes)
        self.grads = [torch.zeros_like(p) for p in worker.params]
        self.finished = False
        self._times = (0.0, 0.0)
        self._snapshot: tuple[int, bool] | None = None

    def start(self) -> None:
        """The start barrier (every rank ready, common t0)."""
        self.w.ready_and_wait_go({"payload_bytes": self.sbuf.nbytes})

    def grad_hook(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Replace every ``p.grad`` with the mean over the clusters (BF16 on the wire); the
        stop flag travels along, so every rank stops on the same step."""
        w = self.w
        flag = w.stop.is_set() or w.now() > w.spec.max_time_s
        self.sbuf.pack([p.grad for p in params], flag)
        self._times = synced_allreduce(w, self.sbuf)
        self.sbuf.mean_into(self.grads, w.world)
        for p, g in zip(params, self.grads):
            p.grad.copy_(g)

    def before_step(self, trainer: ClusterTrainer, stop: threading.Event) -> bool:
        """Save the previous step's snapshot (rank 0); False after the last step."""
        if self._snapshot is not None and self.w.rank == 0:
            global_tokens, final = self._snapshot
            self.w.maybe_snapshot(self.w.params, global_tokens, force=final,
                                  tag="final" if final else None)
        self._snapshot = None
        return not self.finished

    def held(self, trainer: ClusterTrainer, stop: threading.Event) -> None:
        """Never holds: a baseline trains every step (its sync is a barrier of its own)."""
        return None

    def after_step(self, trainer: ClusterTrainer, result: StepResult,
                   stop: threading.Event) -> dict[str, Any]:
        """The step's sync fields; the run ends after the budget's step or a stop flag."""
        step = trainer.steps
        global_tokens = step * self.w.world * self.tpb
        self.finished = self.sbuf.flag or step == self.steps
        self._snapshot = (global_tokens, self.finished)
        wait_s, comm_s = self._times
        return {"global_tokens": global_tokens, "sync": True, "wait_s": round(wait_s, 4),
                "comm_s": round(comm_s, 4), "bytes": self.sbuf.nbytes}

    def starved(self, trainer: ClusterTrainer, stop: threading.Event) -> None:
        """Never: a fixed-assignment sampler cycles through its chunks."""


def run(worker: Worker) -> None:
    """The data-parallel loop of one rank (module docstring); returns when all ranks stop."""
    import torch.distributed as dist

    sync = GradientAllReduce(worker)
    sync.start()
    worker.train(sync)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``--run-dir`` (holds ``spec.json``) and ``--rank``."""

    def body(worker: Worker) -> None:
        init_gloo(worker.spec, worker.rank)
        run(worker)

    worker_main("python -m dips.baselines.real_dp", argv, body)


if __name__ == "__main__":
    main()
