"""``python -m dips.cluster``: one cluster, as one process or as a torchrun job (issue 14; §5).

The same options as ``dips cluster`` (:func:`dips.node.cli.cluster`)::

    torchrun --nnodes 1 --nproc-per-node 2 -m dips.cluster --leader HOST:PORT \\
        --cluster-id ID --state-dir DIR (--tls DIR | --insecure)

With ``WORLD_SIZE > 1`` (torchrun) each rank is a DDP replica (or an FSDP2 shard, ``parallel:
fsdp2``, or pipeline stage r, ``parallel: pipeline``) and a stage worker (:mod:`dips.node.cluster_ddp`); only rank 0 talks to the leader, so only rank 0 reads the TLS
bundle (``--tls`` need not exist on the other nodes). ``--device`` (cpu, cuda; default the
cluster config's, else cuda when available) places the model: each rank on ``cuda:LOCAL_RANK``.
Without torchrun it is ``dips cluster``.
Exit codes as ``dips cluster``: 0 stopped or the run finished, 2 could not start, other
non-zero a failure (a rank lost: the cluster is restarted by torchrun or the operator).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from dips.node.cli import (
    DeviceOpt,
    Insecure,
    LeaderAddr,
    LogFormat,
    MetricsHost,
    MetricsPort,
    StateDirOpt,
    Tls,
    _logging,
    _run,
)


def cluster(leader_addr: LeaderAddr,
            cluster_id: Annotated[str, typer.Option("--cluster-id", help="this cluster's id")],
            state_dir: StateDirOpt, tls: Tls = None, insecure: Insecure = False,
            cache_dir: Annotated[Optional[Path], typer.Option(
                "--cache-dir", help="tokenizer/corpus cache (default: the config's)")] = None,
            stages: Annotated[Optional[int], typer.Option(
                "--stages", min=1, help="stage workers of a one-process cluster (default: the "
                                        "run config's; under torchrun: one per rank)")] = None,
            metrics_port: MetricsPort = None, metrics_host: MetricsHost = "0.0.0.0",
            log_format: LogFormat = "text", device: DeviceOpt = None,
            ) -> None:
    """A cluster's training loop (§3): H inner AdamW steps, push, verdict, pull; under
    torchrun, DDP replicas, FSDP2 shards or pipeline stages whose ranks are the stage
    workers."""
    from dips.algo.refusal import Refused
    from dips.node.cluster import run_cluster
    from dips.node.common import RoleError, credentials
    from dips.train.run import stop_on_signals
    from dips.wire.pki import Identity

    rank = int(os.environ.get("RANK", "0") or 0)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    _logging(f"cluster-{cluster_id}" + (f"-rank{rank}" if world > 1 else ""), log_format)
    stop = stop_on_signals()
    _run("cluster", lambda: run_cluster(
        leader_addr, cluster_id, state_dir.resolve(),
        credentials(tls, insecure, Identity.cluster(cluster_id)) if rank == 0 else None, stop,
        cache_dir=cache_dir, stages=stages, metrics_port=metrics_port,
        metrics_host=metrics_host, device=device),
        (RoleError, OSError, ValueError, RuntimeError, Refused))


def main() -> None:
    """Entry point of ``python -m dips.cluster``."""
    typer.run(cluster)


if __name__ == "__main__":
    main()
