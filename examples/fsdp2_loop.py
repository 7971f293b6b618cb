"""Your own training loop as one Di-PS cluster: a torchrun job, FSDP2, the dips library API.

Start the run first (``dips launch --config RUN.yaml`` or the role commands ``dips leader`` and
``dips follower``), then, on the cluster's nodes::

    torchrun --nproc-per-node 2 examples/fsdp2_loop.py --leader HOST:PORT \\
        --cluster-id mine --tls pki/cluster-mine       # or --insecure on a trusted network

Every rank builds the run's model (the leader checks its fingerprint at the join), shards it
with ``fully_shard`` and trains its share of each of the cluster's batches with its own AdamW
step. ``ClusterJob`` makes rank r the stage worker of layer block r (it pushes and pulls that
block straight to the followers) and rank 0 the one rank that talks to the leader; every
``inner.H`` steps ``step_done`` pushes, waits for the verdict and pulls the new global model
into every shard.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from dips.node.attempt import init_attempt_group
from dips.node.job import ClusterJob
from dips.roles.layers import blocks_prefix
from dips.train.lease import NoData
from dips.train.model import build_model
from dips.train.run import stop_on_signals
from dips.wire.pki import Identity
from dips.wire.security import Credentials


def args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--leader", required=True, help="HOST:PORT of the run's leader")
    p.add_argument("--cluster-id", required=True, help="this cluster's id in the run")
    p.add_argument("--tls", type=Path, help="rank 0's cluster bundle (dips init)")
    p.add_argument("--insecure", action="store_true", help="plaintext gRPC (trusted network)")
    p.add_argument("--cache-dir", type=Path, help="tokenizer/corpus cache (default: the run's)")
    p.add_argument("--state-dir", type=Path, help="rank 0 locks it: one process of this "
                                                  "cluster at a time")
    return p.parse_args()


def main() -> None:
    a = args()
    cuda = torch.cuda.is_available()
    # init_process_group on a store of this torchrun attempt: --max-restarts then works
    init_attempt_group("cpu:gloo,cuda:nccl" if cuda else "gloo", timeout_s=1800)
    rank = dist.get_rank()
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    creds = None
    if rank == 0:  # only rank 0 talks to the leader
        creds = (Credentials.tls(a.tls) if a.tls else
                 Credentials.insecure(Identity.cluster(a.cluster_id)))
    # SIGTERM or Ctrl-C: every rank leaves at the same step, and the leader hears it leave.
    job = ClusterJob(a.leader, a.cluster_id, creds, stop=stop_on_signals(),
                     state_dir=a.state_dir)
    cfg = job.config
    data = job.data(a.cache_dir)  # this rank's rows of the cluster's leased windows

    model = build_model(cfg.model, cfg.seed).to(device)
    for block in model.get_submodule(blocks_prefix(model)):  # each decoder block (LLaMA's
        fully_shard(block)  # model.layers, GPT-2's transformer.h, ...), then the rest
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.inner.weight_decay)

    if not job.join(model):  # pulls the global model into every shard
        job.close()
        return
    step = 0
    while job.running():
        try:
            batch = data.next_batch().to(device)
        except NoData:  # the leased windows are used up: push what was trained, lease more
            job.starved()
            continue
        logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()  # FSDP2 averages the gradients over the ranks
        if cfg.inner.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        mean = loss.detach().reshape(1).cpu()
        dist.all_reduce(mean, group=job.ranks.control)  # the cluster's loss, for the record
        push = job.step_done(tokens=data.tokens_per_batch, loss=float(mean) / job.world)
        if push is not None and rank == 0:
            print(f"step {step}: loss {float(mean) / job.world:.3f}; pushed "
                  f"{'accepted' if push['accepted'] else 'rejected: ' + push['reason']}, "
                  f"now at version {push['version']}", flush=True)
    if rank == 0:
        print(f"stopping after {step} steps: {job.finished or 'stopped'}", flush=True)
    job.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
