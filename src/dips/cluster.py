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

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc is imported: see dips.cli

import typer  # noqa: E402

from dips.node.cli import cluster  # noqa: E402

__all__ = ["cluster", "main"]


def main() -> None:
    """Entry point of ``python -m dips.cluster`` (it exits within
    :data:`dips.node.common.EXIT_BOUND_S` seconds of the cluster's end)."""
    from dips.node.common import run_bounded

    run_bounded(lambda: typer.run(cluster))


if __name__ == "__main__":
    main()
