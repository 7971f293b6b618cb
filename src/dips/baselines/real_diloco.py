"""Real-time synchronous DiLoCo: H inner steps, then a barrier all-reduce of Δ (§3, §4).

One process per cluster (``python -m dips.baselines.real_diloco --run-dir D --rank i``).  Every
cluster runs H inner AdamW steps from the common θ_t, forms its pseudo-gradient
Δ_i = θ_t − θ_i (§3, :func:`dips.algo.pseudo_gradient`), waits for every other cluster
(barrier), all-reduces the Δ with gloo in BF16 padded to ``payload_bytes``, averages them
uniformly and applies one Nesterov outer step
(lr 0.7, momentum 0.8; :func:`dips.algo.nesterov_step`, FP32) to its replica of θ; the replicas
stay identical.  The inner AdamW state carries over between rounds.  The barrier makes every
round as long as the slowest cluster's compute plus the slowest link (§4).

Stops after ``ceil(token_budget / (N × H × tokens per step))`` rounds, or at the first round
after any rank was signalled or passed ``max_time_s`` (a flag in the all-reduce; a signalled
rank cuts its round short, the others finish theirs).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from dips.baselines.real_common import (OuterReplica, SyncBuffer, Worker, init_gloo,
                                        synced_allreduce, worker_main)
from dips.train.trainer import ClusterTrainer, StepResult

__all__ = ["AllReduceDiLoCo", "main", "run"]


class AllReduceDiLoCo:
    """Synchronous DiLoCo as the sync of :func:`dips.train.run.run_loop` (module docstring).

    Before an inner step, once H steps of the round are done (or this rank must stop), it
    all-reduces Δ, applies the outer step and writes the round's ``sync`` record; rank 0
    saves the global θ every ``eval_every_tokens`` global tokens and at the end.

    Args:
        worker: this cluster's process.
    """

    grad_hook = None

    def __init__(self, worker: Worker) -> None:
        self.w = worker
        spec = worker.spec
        self.H, self.tpb = spec.inner.H, worker.trainer.tokens_per_batch
        self.rounds = math.ceil(spec.token_budget / (worker.world * self.H * self.tpb))
        self.sbuf = SyncBuffer(worker.n_real, spec.payload_bytes)
        self.outer = OuterReplica(worker.params, spec.outer)  # the global θ_t, replicated
        self.round = 0
        self.in_round = 0  # inner steps since the last sync
        self.finished = False

    def start(self) -> None:
        """The start barrier (every rank ready, common t0)."""
        self.w.ready_and_wait_go({"payload_bytes": self.sbuf.nbytes})

    def before_step(self, trainer: ClusterTrainer, stop: threading.Event) -> bool:
        """Sync after H steps, or at once (a round cut short) when this rank must stop."""
        w = self.w
        if not self.finished and self.in_round:
            flag = stop.is_set() or w.now() > w.spec.max_time_s
            if flag or self.in_round >= self.H:
                self._sync(trainer, flag)
        return not self.finished

    def held(self, trainer: ClusterTrainer, stop: threading.Event) -> None:
        """Never holds: a baseline trains every step (its sync is a barrier of its own)."""
        return None

    def after_step(self, trainer: ClusterTrainer, result: StepResult,
                   stop: threading.Event) -> dict[str, Any]:
        """Count the round's step; nothing to add to the step's record."""
        self.in_round += 1
        return {}

    def starved(self, trainer: ClusterTrainer, stop: threading.Event) -> None:
        """Never: a fixed-assignment sampler cycles through its chunks."""

    def _sync(self, trainer: ClusterTrainer, flag: bool) -> None:
        w, sbuf = self.w, self.sbuf
        self.round += 1
        delta = self.outer.pseudo_gradients(w.params)
        sbuf.pack(delta, flag)
        wait_s, comm_s = synced_allreduce(w, sbuf)
        t = time.monotonic()
        sbuf.mean_into(delta, w.world)
        self.outer.step(delta)
        self.outer.load_into(w.params)
        update_s = time.monotonic() - t
        global_tokens = self.round * w.world * self.H * self.tpb
        self.finished = sbuf.flag or self.round == self.rounds
        self.in_round = 0
        w.record(event="sync", round=self.round, sync=True, tokens=trainer.tokens,
                 global_tokens=global_tokens, wait_s=round(wait_s, 4), comm_s=round(comm_s, 4),
                 update_s=round(update_s, 4), bytes=sbuf.nbytes, applied=w.world)
        if w.rank == 0:
            w.maybe_snapshot(self.outer.theta, global_tokens, force=self.finished,
                             tag="final" if self.finished else None)


def run(worker: Worker) -> None:
    """The synchronous DiLoCo loop of one rank; returns when all ranks stop."""
    import torch.distributed as dist

    sync = AllReduceDiLoCo(worker)
    sync.start()
    worker.train(sync)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``--run-dir`` (holds ``spec.json``) and ``--rank``."""

    def body(worker: Worker) -> None:
        init_gloo(worker.spec, worker.rank)
        run(worker)

    worker_main("python -m dips.baselines.real_diloco", argv, body)


if __name__ == "__main__":
    main()
