"""Real-time synchronous DiLoCo: H inner steps, then a barrier all-reduce of Δ (§3, §4).

One process per cluster (``python -m dips.baselines.real_diloco --run-dir D --rank i``).  Every
cluster runs H inner AdamW steps from the common θ_t, forms its pseudo-gradient
Δ_i = θ_t − θ_i (§3), waits for every other cluster (barrier), all-reduces the Δ with gloo in
BF16 padded to ``payload_bytes``, averages them uniformly and applies one Nesterov outer step
(lr 0.7, momentum 0.8; :func:`dips.algo.nesterov_step`, FP32) to its replica of θ; the replicas
stay identical.  The inner AdamW state carries over between rounds.  The barrier makes every
round as long as the slowest cluster's compute plus the slowest link (§4).

Stops after ``ceil(token_budget / (N × H × tokens per step))`` rounds, or at the first round
after any rank was signalled or passed ``max_time_s`` (a flag in the all-reduce; a signalled
rank cuts its round short, the others finish theirs).
"""

from __future__ import annotations

import math
import time

import torch

from dips.algo import nesterov_step
from dips.baselines.real_common import SyncBuffer, Worker, init_gloo, synced_allreduce, worker_main

__all__ = ["main", "run"]


def run(worker: Worker) -> None:
    """The synchronous DiLoCo loop of one rank; returns when all ranks stop."""
    import torch.distributed as dist

    spec, w = worker.spec, worker
    H, tpb = spec.inner.H, w.sampler.tokens_per_batch
    rounds = math.ceil(spec.token_budget / (w.world * H * tpb))
    sbuf = SyncBuffer(w.n_real, spec.payload_bytes)
    theta = [p.detach().clone() for p in w.params]  # the global θ_t (replicated, FP32)
    momenta = [torch.zeros_like(p) for p in theta]
    delta = [torch.zeros_like(p) for p in theta]
    w.ready_and_wait_go({"payload_bytes": sbuf.nbytes})
    step = 0
    for rnd in range(1, rounds + 1):
        for _ in range(H):
            step += 1
            w.paced_inner_step(step, tpb, spec.inner.grad_clip)
            if w.stop.is_set() or w.now() > spec.max_time_s:
                break
        flag = w.stop.is_set() or w.now() > spec.max_time_s
        with torch.no_grad():
            for d, th, p in zip(delta, theta, w.params):
                torch.sub(th, p, out=d)
        sbuf.pack(delta, flag)
        wait_s, comm_s = synced_allreduce(w, sbuf)
        t = time.monotonic()
        sbuf.mean_into(delta, w.world)
        nesterov_step(theta, momenta, delta, spec.outer_lr, spec.outer_momentum)
        with torch.no_grad():
            for p, th in zip(w.params, theta):
                p.copy_(th)
        update_s = time.monotonic() - t
        global_tokens = rnd * w.world * H * tpb
        stop = sbuf.flag
        w.record(event="sync", round=rnd, sync=True, tokens=step * tpb, global_tokens=global_tokens,
                 wait_s=round(wait_s, 4), comm_s=round(comm_s, 4), update_s=round(update_s, 4),
                 bytes=sbuf.nbytes, applied=w.world)
        if w.rank == 0:
            final = stop or rnd == rounds
            w.maybe_snapshot(theta, global_tokens, force=final, tag="final" if final else None)
        if stop:
            break
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``--run-dir`` (holds ``spec.json``) and ``--rank``."""

    def body(worker: Worker) -> None:
        init_gloo(worker.spec, worker.rank)
        run(worker)

    worker_main("python -m dips.baselines.real_diloco", argv, body)


if __name__ == "__main__":
    main()
