"""Di-PS from your own training loop under torchrun (issue 14; §3, §5, §10, §12).

:class:`ClusterJob` is what ``python -m dips.cluster`` does for its own loop
(:mod:`dips.node.cluster_ddp`), for a loop the user writes: every rank of the torchrun job
creates one after ``init_process_group``, and calls its methods at the same points (each is a
collective on the job's in-cluster groups)::

    job = ClusterJob(leader, cluster_id, creds if rank == 0 else None)
    data = job.data()                        # this rank's rows of the cluster's leased batch
    model = build_model(job.config.model, job.config.seed)  # or any model of the run
    ...  # DDP(model) or fully_shard(...) and your optimizer
    job.join(model)                          # pulls one complete model of a single version
    while job.running():
        try:
            batch = data.next_batch()
        except NoData:
            job.starved(); continue           # pushes what was trained, leases more
        ...  # your inner step
        push = job.step_done(tokens=data.tokens_per_batch, loss=loss)
    job.close()

The ranks split the model's layers into contiguous blocks balanced by bytes, rank r the stage
worker of block r (:func:`dips.roles.cluster_ranks.rank_blocks`): it pushes and pulls its own
block straight to the followers, and after a pull the blocks are broadcast inside the job
(FSDP2: each rank keeps its own shard). Rank 0 alone talks to the leader; only it needs
credentials. The data is the run's (the leader's ledger derives T_j from the windows
trained): :meth:`data` gives each rank its contiguous share of the cluster's batch.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from dips.node.cluster_ddp import BOOT_TIMEOUT_S, _spec, collective_timeout, exit_with_agent
from dips.wire.security import Credentials

__all__ = ["ClusterJob"]


class _Batches:
    """What the sync reads of a trainer: its batch source."""

    def __init__(self, batches: Any) -> None:
        self.batches = batches


class ClusterJob:
    """One torchrun job as one Di-PS cluster (module docstring).

    Args:
        leader: ``HOST:PORT`` of the leader. cluster_id: this cluster's id in the run.
        creds: rank 0's credentials (``Credentials.tls(dir)`` or ``.insecure(identity)``);
            None on the other ranks.
        stop: set it to leave the loop at the next :meth:`running` (any rank).
        state_dir: rank 0 locks it (one cluster process per directory), or None.

    Attributes: ``spec`` (the run spec fetched from the leader by rank 0 and broadcast),
    ``config`` (its RunConfig), ``rank``, ``world``.
    Raises RoleError when rank 0 cannot fetch the spec (a wrong certificate, no leader
    within ``timeouts.startup_s``), on every rank; RuntimeError when a rank fails.
    """

    def __init__(self, leader: str, cluster_id: str, creds: Credentials | None, *,
                 stop: threading.Event | None = None, state_dir: Path | None = None) -> None:
        import torch.distributed as dist

        from dips.roles.rank_comm import Ranks
        from dips.spec import ClusterConfig

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: leave with its agent
            exit_with_agent()
        self.leader, self.cluster_id, self.creds = leader, cluster_id, creds
        self.stop = stop or threading.Event()
        boot = Ranks.control_group(self.rank, self.world, BOOT_TIMEOUT_S, torch.device("cpu"))
        self.spec = _spec(boot, leader, cluster_id, state_dir, creds, self.stop)
        self.config = self.spec.config
        listed = [c for c in self.config.clusters if c.id == cluster_id]
        self.me = listed[0] if listed else ClusterConfig(id=cluster_id)
        self.ranks = Ranks.control_group(self.rank, self.world, collective_timeout(
            self.me.collective_timeout_s, self.config.timeouts), torch.device("cpu"))
        self._data: Any = None
        self._sync: Any = None
        self._worker: Any = None

    def data(self, cache_dir: Path | None = None) -> Any:
        """This rank's view of the cluster's leased data (:class:`dips.train.ddp.RankSampler`:
        ``next_batch()`` gives this rank's contiguous rows, ``(rows, seq_len + 1)`` int64, of
        the cluster's next ``inner.batch_size`` windows; raises NoData when the leased
        windows are used up). Local rank 0 fills the node's cache first."""
        import torch.distributed as dist

        from dips.node.common import run_data
        from dips.train.ddp import RankSampler
        from dips.train.lease import LeaseSampler
        from dips.train.sampler import make_chunks

        cfg, local = self.config, int(os.environ.get("LOCAL_RANK", "0"))
        cache = (cache_dir or cfg.data.cache_dir).resolve()
        if local != 0:
            dist.barrier(group=self.ranks.control)
        tokens = run_data(self.spec, cache, f"cluster {self.cluster_id}, rank {self.rank}")
        if local == 0:
            dist.barrier(group=self.ranks.control)
        sampler = LeaseSampler(tokens.train, make_chunks(len(tokens.train), cfg.data.num_chunks),
                               cfg.inner.seq_len, cfg.inner.batch_size, seed=cfg.seed,
                               ahead=cfg.data.lease_ahead)
        self._data = RankSampler(sampler, self.rank, self.world)
        self._vocab = (cfg.data, cache)
        return self._data

    def join(self, model: torch.nn.Module, layer_of: Callable[[str], str] | None = None) -> bool:
        """Make the ranks the stage workers of ``model`` (plain, DDP-wrapped's ``.module``,
        or ``fully_shard``-ed) and join: pull one complete model of a single version into
        every rank. Call after :meth:`data`. Returns False when the run already finished or
        ``stop`` was set (leave the loop). Raises RuntimeError as the cluster command."""
        from dips.roles.cluster_ranks import RankLeadClient, RankWorker, rank_blocks
        from dips.roles.layers import group_layers
        from dips.train.datasource import load_vocab
        from dips.train.ddp import RankSync
        from dips.train.dips_sync import DiPSSync
        from dips.train.model import fingerprint_of, layer_namer

        if self._data is None:
            raise RuntimeError("ClusterJob.join: call data() first (the cluster's ledger)")
        cfg = self.config
        layer_of = layer_of or layer_namer(model, cfg.model.layer_pattern)
        layers = group_layers(model, layer_of)
        blocks = rank_blocks([sum(p.numel() * 4 for _, p in ps) for _, ps in layers], self.world)
        self._worker = RankWorker(self.ranks, layers, blocks, None, cfg.outer.wire_dtype,
                                  self.stop)
        lead = None
        if self.rank == 0:
            client = RankLeadClient(
                model, self.leader, self.cluster_id, self.creds, worker=self._worker,
                H=cfg.inner.H, stages=len(blocks), timeout_s=cfg.timeouts.push_s,
                layer_of=layer_of, admit_timeout_s=cfg.timeouts.admit_s,
                heartbeat_interval_s=cfg.membership.heartbeat_interval_s, data=self._data,
                stop=self.stop, wire_dtype=cfg.outer.wire_dtype,
                hold_after=cfg.inner.hold_after,
                fingerprint=fingerprint_of(model, load_vocab(*self._vocab)).to_json())
            lead = DiPSSync(client)
        self._sync = RankSync(self.ranks, self._worker, self._data, lead)
        return self._sync.join(self.stop, cfg.timeouts.startup_s)

    def running(self) -> bool:
        """Whether to train another step: no rank was stopped and the run goes on. While the
        cluster holds (it cannot sync: the leader unreachable for ``inner.hold_after`` sync
        intervals, a verdict or a re-join pending; :mod:`dips.algo.hold`) it waits here, on
        every rank, and tries again, until it may train or stops."""
        while self._sync.before_step(None, self.stop):
            if self._sync.held(_Batches(self._data), self.stop) is None:
                return True
        return False

    @property
    def finished(self) -> str | None:
        """Why the run finished (the leader's reason, e.g. ``"max outer steps"``) on rank 0;
        None while it goes on, after a stop, and on the other ranks."""
        lead = self._sync.lead if self._sync is not None else None
        return (lead.client.finished or None) if lead is not None else None

    def step_done(self, tokens: int, loss: float | None = None) -> dict[str, Any] | None:
        """Count one inner step of the cluster (``tokens``: all ranks', e.g.
        ``data.tokens_per_batch``; ``loss``: nats/token); every ``inner.H`` steps push, wait
        for the verdict and pull. Returns the push's record on every rank (``accepted``,
        ``version``, ``round``, ``tokens``, ``score``, ``reason``, seconds), else None."""
        from dips.train.trainer import StepResult

        step = StepResult(float("nan") if loss is None else float(loss), int(tokens), 0.0)
        return self._sync.after_step(_Batches(self._data), step, self.stop).get("push")

    def starved(self) -> dict[str, Any] | None:
        """The leased windows are used up (NoData on every rank): push what was trained,
        lease more (wait 0.5 s if none). Returns the push's record, if one was made."""
        return self._sync.starved(_Batches(self._data), self.stop).get("push")

    def close(self) -> None:
        """Leave the run (rank 0) and close every rank's stage worker."""
        if self._sync is not None and self._sync.lead is not None:
            self._sync.lead.client.close()
        if self._worker is not None:
            self._worker.close()

