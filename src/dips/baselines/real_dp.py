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
import time

import torch
import torch.nn.functional as F

from dips.baselines.real_common import SyncBuffer, Worker, init_gloo, synced_allreduce, worker_main

__all__ = ["main", "run"]


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    # The same mean next-token cross-entropy as dips.train.loop.inner_step (logits upcast).
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def run(worker: Worker) -> None:
    """The data-parallel loop of one rank (module docstring); returns when all ranks stop."""
    import torch.distributed as dist

    spec, w = worker.spec, worker
    tpb = w.sampler.tokens_per_batch
    steps = math.ceil(spec.token_budget / (w.world * tpb))
    sbuf = SyncBuffer(w.n_real, spec.payload_bytes)
    grads = [torch.zeros_like(p) for p in w.params]
    w.ready_and_wait_go({"payload_bytes": sbuf.nbytes})
    for step in range(1, steps + 1):
        w.model.train()
        t = time.monotonic()
        w.opt.zero_grad(set_to_none=True)
        loss = _loss(w.model, w.sampler.next_batch())
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"cluster {w.me.id}: step {step} loss is {value}")
        loss.backward()
        compute_s = time.monotonic() - t
        delay_s = w.pace(compute_s)
        flag = w.stop.is_set() or w.now() > spec.max_time_s
        sbuf.pack([p.grad for p in w.params], flag)
        wait_s, comm_s = synced_allreduce(w, sbuf)
        t = time.monotonic()
        sbuf.mean_into(grads, w.world)
        for p, g in zip(w.params, grads):
            p.grad.copy_(g)
        if spec.inner.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(w.params, spec.inner.grad_clip)
        w.opt.step()
        compute_s += time.monotonic() - t
        global_tokens = step * w.world * tpb
        w.record(step=step, loss=round(value, 5), tokens=step * tpb, global_tokens=global_tokens,
                 compute_s=round(compute_s, 4), delay_s=round(delay_s, 4), sync=True,
                 wait_s=round(wait_s, 4), comm_s=round(comm_s, 4), bytes=sbuf.nbytes)
        stop = sbuf.flag
        if w.rank == 0:
            w.maybe_snapshot(w.params, global_tokens, force=stop or step == steps,
                             tag="final" if stop or step == steps else None)
        if stop:
            break
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``--run-dir`` (holds ``spec.json``) and ``--rank``."""

    def body(worker: Worker) -> None:
        init_gloo(worker.spec, worker.rank)
        run(worker)

    worker_main("python -m dips.baselines.real_dp", argv, body)


if __name__ == "__main__":
    main()
