"""A cluster as a torchrun job of DDP replicas: data split, inner step and sync (issue 14; §3, §5, §12).

Every rank holds a replica wrapped in ``torch.nn.parallel.DistributedDataParallel`` (or, with
``parallel: fsdp2``, a shard of the model under ``fully_shard``, which reduces gradients the
same way); gradients are averaged inside the cluster every inner step, so the replicas stay
identical and the cluster takes one inner AdamW step per step of its ranks.

* Data (§12): one ledger for the cluster. Every rank keeps the same
  :class:`~dips.train.lease.LeaseSampler` state (rank 0's, sent with every ``end`` message, see
  :mod:`dips.roles.cluster_ranks`), takes the same next ``batch_size`` windows (the
  cluster's batch, as for a one-process cluster) and trains on its own contiguous share of
  them (:func:`split_rows`): no window is trained twice, and the tokens counted for the
  cluster (and reported to the leader as T_j) are the sum over ranks — one sync interval,
  H × batch_size × seq_len, whatever the ranks, which is what the leader weighs a push by
  (``LeaderConfig.push_tokens_weighed``; more ranks make a cluster's steps faster, §13). Each rank reads only its own windows from its own copy of the token stream.
* Inner step (§3, :class:`RankTrainer`): each rank's mean loss is weighted by its share of the
  windows so that DDP's average is the gradient of the cluster's mean loss; the loss is
  all-reduced before backward, so a non-finite loss stops every rank at the same step.
* Sync (:class:`RankSync`): rank 0 runs :class:`dips.train.dips_sync.DiPSSync` over its
  :class:`dips.roles.cluster_ranks.RankLeadClient`; the other ranks follow its commands.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch
import torch.distributed as dist

from dips.algo.refusal import Refusal, Refused
from dips.roles.cluster_ranks import RankWorker
from dips.roles.rank_comm import Ranks
from dips.train.dips_sync import DiPSSync
from dips.train.lease import LeaseSampler
from dips.train.loop import _check_tokens, _next_token_loss
from dips.train.trainer import ClusterTrainer, StepResult

__all__ = ["NullLog", "RankSampler", "RankSync", "RankTrainer", "split_rows"]


def split_rows(n: int, world: int, rank: int) -> range:
    """Rank ``rank``'s contiguous share of ``n`` windows among ``world`` ranks: rows
    ``[n·rank // world, n·(rank+1) // world)`` (shares differ by at most one; empty when
    ``n < world`` for some ranks). Raises ValueError for ``n < 0`` or a rank outside
    ``[0, world)``."""
    if n < 0 or not 0 <= rank < world:
        raise ValueError(f"split_rows: n = {n}, rank = {rank}, world = {world}")
    return range(n * rank // world, n * (rank + 1) // world)


class RankSampler:
    """One rank's view of the cluster's leased data (module docstring).

    The ledger side (:class:`dips.roles.client.LedgerData`: holdings, positions, wanted) and
    the counters (``batch_size``, ``available()``, ``drain``) are the cluster's: a step takes
    ``batch_size`` windows, split among the ranks. :meth:`next_batch` returns only this rank's
    rows, ``(rows, T+1)`` int64; after it, ``last_total`` is the cluster's windows of the step
    and ``last_mine`` this rank's (0 when a short last batch leaves it none: it then gets one
    window to keep DDP in step, weighted 0 by :class:`RankTrainer`).

    Args: sampler: the cluster's LeaseSampler (``batch_size`` per cluster step); rank,
    world: ints.
    """

    def __init__(self, sampler: LeaseSampler, rank: int, world: int) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside [0, {world})")
        self.inner, self.rank, self.world = sampler, rank, world
        self.last_total = self.last_mine = 0

    @property
    def batch_size(self) -> int:
        """Windows per cluster step (all ranks together)."""
        return self.inner.batch_size

    @property
    def seq_len(self) -> int:
        return self.inner.seq_len

    @property
    def tokens_per_batch(self) -> int:
        """Tokens per cluster step (all ranks): batch_size × seq_len."""
        return self.batch_size * self.inner.seq_len

    @property
    def drain(self) -> bool:
        return self.inner.drain

    @drain.setter
    def drain(self, value: bool) -> None:
        self.inner.drain = value

    def set_holdings(self, holdings: list[tuple[int, int]]) -> None:
        self.inner.set_holdings(holdings)

    def merge_holdings(self, holdings: list[tuple[int, int]]) -> None:
        self.inner.merge_holdings(holdings)

    def positions(self) -> dict[int, int]:
        return self.inner.positions()

    def wanted(self) -> int:
        return self.inner.wanted()

    def available(self) -> int:
        return self.inner.available()

    def next_batch(self) -> torch.Tensor:
        """This rank's rows of the cluster's next step (class docstring). Raises NoData as
        LeaseSampler does, on every rank alike (they hold the same state)."""
        windows = self.inner.next_windows(self.batch_size)
        share = split_rows(len(windows), self.world, self.rank)
        mine = windows[share.start:share.stop]
        self.last_total, self.last_mine = len(windows), len(mine)
        return self.inner.read(mine or windows[:1])

    def state(self) -> dict[str, Any]:
        """The data position to send to the other ranks (JSON)."""
        return {"held": sorted([c, p] for c, p in self.inner.positions().items()),
                "drain": self.inner.drain}

    def load_state(self, state: dict[str, Any]) -> None:
        """Adopt rank 0's :meth:`state` exactly."""
        self.inner.set_holdings([(int(c), int(p)) for c, p in state["held"]])
        self.inner.drain = bool(state["drain"])


class RankTrainer(ClusterTrainer):
    """A :class:`~dips.train.trainer.ClusterTrainer` whose forward and backward run through
    ``ddp`` (the DDP wrapper of ``model``, or ``model`` itself under FSDP2) on ``ranks.device`` with a :class:`RankSampler`;
    ``steps``/``tokens`` count the cluster's (all ranks'). Returned losses are the cluster's
    mean (nats/token). Raises FloatingPointError on every rank when the cluster's loss is
    not finite (nothing is applied)."""

    def __init__(self, cluster_id: str, model: torch.nn.Module, ddp: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, batches: RankSampler,
                 grad_clip: float | None, ranks: Ranks) -> None:
        super().__init__(cluster_id, model, optimizer, batches, grad_clip)
        self.ddp, self.ranks = ddp, ranks

    def accumulate(self, divide_by: int = 1) -> float:
        batches: RankSampler = self.batches  # type: ignore[assignment]
        batch = batches.next_batch()
        _check_tokens(self.model, batch, "batch")
        share = batches.last_mine / batches.last_total
        self.model.train()
        loss = _next_token_loss(self.ddp, batch.to(self.ranks.device, non_blocking=True))
        mean = (loss.detach() * share).reshape(1).clone()
        dist.all_reduce(mean)  # the cluster's mean loss, on every rank before any backward
        value = float(mean.item()) / divide_by
        if not math.isfinite(value):
            raise FloatingPointError(f"cluster {self.cluster_id}: step {self.steps + 1}: "
                                     f"inner_step loss is {value}; optimizer step skipped")
        # DDP averages over ranks: weight each rank's mean by its share × world.
        (loss * (share * self.ranks.world / divide_by)).backward()
        self.steps += 1
        self.last_tokens = batches.last_total * (int(batch.shape[1]) - 1)
        self.tokens += self.last_tokens
        return value


class NullLog:
    """A :class:`dips.train.run.TrainLog` that writes nothing (ranks other than 0)."""

    def write(self, rec: dict[str, Any]) -> None:
        pass

    def step(self, *args: Any) -> None:
        pass

    def close(self) -> None:
        pass


class RankSync:
    """The Di-PS sync of one rank of a multi-rank cluster (:class:`dips.train.run.Sync`).

    Rank 0 (``lead`` given) runs ``lead``'s join / after_step / starved and then sends
    ``end`` with its data position; the other ranks (``lead`` None) follow rank 0's commands
    (:meth:`dips.roles.cluster_ranks.RankWorker.serve`) and adopt the position. Whether to go
    on is decided by all ranks together (any rank's stop request, or the run finished).

    Args: ranks; worker: this rank's RankWorker; sampler: its RankSampler; lead: rank 0's
    DiPSSync over a RankLeadClient, else None.
    """

    grad_hook = None

    def __init__(self, ranks: Ranks, worker: RankWorker, sampler: RankSampler,
                 lead: DiPSSync | None) -> None:
        self.ranks, self.worker, self.sampler, self.lead = ranks, worker, sampler, lead

    def _lead(self, fn: Any) -> Any:
        """Rank 0: ``fn()``, then ``end`` (with the error if it raised, so that every rank
        stops). Others: follow until ``end``; raise RuntimeError if rank 0 failed."""
        if self.lead is None:
            msg = self.worker.serve()
            self.sampler.load_state(msg["data"])
            if msg.get("error"):
                raise RuntimeError(f"rank 0 failed: {msg['error']}")
            return msg.get("value")
        try:
            value = fn()
        except BaseException as exc:
            try:
                self.lead.client.end({"data": self.sampler.state(), "error": repr(exc)})
            except Exception:
                pass  # a broken group: the other ranks fail on their own
            raise
        self.lead.client.end({"data": self.sampler.state(), "value": value})
        return value

    def count_from(self, steps: int, tokens: int) -> None:
        """Rank 0's client counts on from a resumed state's counters (the others report
        nothing to the leader)."""
        if self.lead is not None:
            self.lead.count_from(steps, tokens)

    def join(self, stop: threading.Event, timeout_s: float) -> bool:
        """Join on rank 0 (:meth:`DiPSSync.join`); False when the run already finished or
        ``stop`` was set while waiting (a clean exit on every rank). Raises as DiPSSync."""
        def go() -> bool:
            assert self.lead is not None
            try:
                self.lead.join(stop, timeout_s)
                return True
            except Refused as exc:
                if exc.code is not Refusal.RUN_FINISHED:
                    raise
                return False
            except RuntimeError:
                if stop.is_set():
                    return False
                raise
        return bool(self._lead(go))

    #: What :meth:`before_step` found on all ranks: 2 stop, 1 rank 0 holds, 0 train.
    _GO, _HOLD, _DONE = 0, 1, 2
    _agreed = 0

    def before_step(self, trainer: ClusterTrainer, stop: threading.Event) -> bool:
        """Go on unless some rank was stopped or the run finished; whether rank 0 holds
        (:mod:`dips.algo.hold`) comes with the same all-reduce, for :meth:`held`."""
        client = self.lead.client if self.lead is not None else None
        done = stop.is_set() or bool(client is not None and client.finished)
        holds = client is not None and (client.holding or client.held() is not None)
        self._agreed = self.ranks.most(self._DONE if done else self._HOLD if holds else self._GO)
        return self._agreed != self._DONE

    def held(self, trainer: ClusterTrainer, stop: threading.Event) -> dict[str, Any] | None:
        """Rank 0's hold tick (:meth:`DiPSSync.held`) while every other rank follows its
        commands (a sync tried meanwhile moves every rank's blocks), when :meth:`before_step`
        found rank 0 holding; else None at once, with no collective. Each tick waits about a
        second at most, so the ranks meet in a collective that often, far within the control
        group's timeout, however long the hold."""
        if self._agreed != self._HOLD:
            return None
        return self._lead(lambda: self._record(self.lead.held(trainer, stop)))

    def sync_due(self, trainer: ClusterTrainer) -> bool:
        """Rank 0 (the one that writes ``train.jsonl``): :meth:`DiPSSync.sync_due`; no
        collective."""
        return self.lead is not None and self.lead.sync_due(trainer)

    def after_step(self, trainer: ClusterTrainer, result: StepResult,
                   stop: threading.Event) -> dict[str, Any]:
        return self._lead(lambda: self._record(self.lead.after_step(trainer, result, stop))) or {}

    def starved(self, trainer: ClusterTrainer, stop: threading.Event) -> dict[str, Any]:
        return self._lead(lambda: self._record(self.lead.starved(trainer, stop))) or {}

    def _record(self, fields: dict[str, Any] | None) -> dict[str, Any] | None:
        """Add what each rank pushed (layers, bytes the followers acknowledged) and the
        replicas' per-shard checksums after the pull to a sync step's record."""
        if fields is not None and "push" in fields:
            client = self.lead.client  # type: ignore[union-attr]
            fields["push"]["ranks"] = [{"rank": r["rank"], "layers": r["layers"],
                                        "bytes": r["acked"], "error": r["error"]}
                                       for r in client.last_ranks]
            fields["push"]["replicas"] = {"version": client.version,
                                          "checksums": self.worker.checksums}
        return fields
