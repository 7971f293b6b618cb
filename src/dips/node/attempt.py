"""The process group of one torchrun attempt, so that ``torchrun --max-restarts N`` can restart
a cluster's ranks in place (issue 14: "a rank's failure takes down only that cluster (torchrun
restarts it, it re-joins)").

Why: torchrun's agent keeps one TCPStore for the whole job (the static rendezvous of
``--master-addr/--master-port`` creates it once; the c10d rendezvous shares its server too)
and its workers connect to it as clients (``TORCHELASTIC_USE_AGENT_STORE=True``).
``init_process_group("env://")`` then uses that store with no prefix per attempt (torch 2.13,
``torch.distributed.rendezvous._create_c10d_store``: "We create a new TCPStore for every retry
so no need to add prefix", which the static rendezvous does not do), so the ranks of a
restarted attempt read the keys the previous attempt left there: gloo's peer addresses (measured
2026-12-03: ``Gloo connectFullMesh failed ... Connection refused`` within 3 s, to a port of the
dead attempt) or a barrier's counters (the next attempt hung in ``init_process_group``);
pytorch/pytorch#135712 is the same for NCCL's unique id.

:func:`init_attempt_group` builds the store itself and namespaces it by the attempt,
``TORCHELASTIC_RESTART_COUNT`` (the agent's count of its restarts of this worker group: the
same on every rank of one node; on several nodes the same as long as each failure restarts
every node's workers, which a broken collective does).
"""

from __future__ import annotations

import os
from datetime import timedelta


def restart_count() -> int:
    """torchrun's ``TORCHELASTIC_RESTART_COUNT`` (0 when unset: a first attempt, or no
    torchrun). Raises ValueError naming the variable when it is not a non-negative integer."""
    raw = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"TORCHELASTIC_RESTART_COUNT={raw!r}: not a non-negative integer")
    return n


def attempt_prefix(attempt: int) -> str:
    """The store prefix of attempt ``attempt`` (0 = torchrun's first start)."""
    return f"dips/attempt_{attempt}/"


def init_attempt_group(backend: str, timeout_s: float) -> int:
    """``torch.distributed.init_process_group(backend)`` for this rank (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` from torchrun's environment, as
    ``env://``) on a store of this attempt alone (module docstring); collectives bounded by
    ``timeout_s`` seconds. Returns the attempt number. Raises ValueError (a bad environment
    variable, named) or what ``init_process_group`` raises (RuntimeError, DistStoreError:
    the store or a peer did not answer within ``timeout_s``)."""
    import torch.distributed as dist

    attempt = restart_count()
    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    dist.init_process_group(backend, store=dist.PrefixStore(attempt_prefix(attempt), store),
                            rank=rank, world_size=world, timeout=timeout)
    return attempt
