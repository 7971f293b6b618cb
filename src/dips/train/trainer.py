"""One cluster's side of training: model, inner AdamW, batch source, counters (§3, §12, §13).

Every method of dips trains a cluster the same way, whatever synchronises it: H inner AdamW
steps (§3; lr 6e-5 in §13, tuned higher for these small models) on batches of the cluster's
data, with the gradient clipped to ``inner.grad_clip``.  :class:`ClusterTrainer` is that
cluster: the real-time loop (:func:`dips.train.run.run_loop`) drives it for ``dips launch``
and the real-time baselines, the virtual-time engines (:mod:`dips.emu.vworld`) drive it from
their event queues.  :func:`build_trainer` is the one place that turns the typed spec (model,
data, inner loop, seed, cluster id) into a trainer, so that every caller gets the same
model, the same optimizer and the same batches for the same cluster.

Batch sources (§12):

* ``assignment`` given (the baselines, virtual time): a fixed
  :class:`~dips.train.sampler.BatchSampler` over the cluster's round-robin share of the chunks,
  seeded with :func:`sampler_seed` (different per cluster, the same in every caller);
* ``assignment`` None (Di-PS): a ledger-aware :class:`~dips.train.lease.LeaseSampler` whose
  chunks the leader leases; its window order is a property of the chunk, so it is seeded with
  the run's seed, the same in every cluster.
"""

from __future__ import annotations

import re
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from dips.spec import DataConfig, InnerConfig, ModelConfig
from dips.train.loop import backward_loss, check_grad_clip, optimizer_step

if TYPE_CHECKING:
    from dips.train.corpus import TokenData

__all__ = ["BatchSource", "ClusterTrainer", "GradHook", "StepResult", "build_trainer",
           "resolve_device", "sampler_seed"]

GradHook = Callable[[Sequence[torch.nn.Parameter]], None]
"""Called between backward and the optimizer step with the model's parameters (``p.grad``
holds this cluster's gradient); it may overwrite ``p.grad`` in place, e.g. with the
all-reduced mean of every cluster's gradient (per-step data parallel)."""


class BatchSource(Protocol):
    """What a trainer draws its batches from (BatchSampler, LeaseSampler)."""

    @property
    def tokens_per_batch(self) -> int:
        """Tokens trained on per inner step: batch_size × seq_len."""
        ...

    def next_batch(self) -> torch.Tensor:
        """(batch_size, seq_len + 1) int64 token ids; LeaseSampler raises NoData when empty."""
        ...


@dataclass(frozen=True)
class StepResult:
    """One inner step: ``loss`` (nats/token, before the update), ``tokens`` trained (tokens),
    ``compute_s`` (wall seconds of batch, forward, backward and optimizer step; the time
    spent in a gradient hook is not counted)."""

    loss: float
    tokens: int
    compute_s: float


def sampler_seed(seed: int, cluster_id: str) -> int:
    """Seed of cluster ``cluster_id``'s fixed-assignment BatchSampler: ``seed·7919 + crc32(id)``.

    The one formula every caller uses (virtual time, real-time baselines), so a cluster draws
    the same batches whichever engine runs it.
    """
    return seed * 7919 + zlib.crc32(cluster_id.encode())


def resolve_device(wanted: str | None, local_rank: int | None = None) -> torch.device:
    """The device a cluster's model and inner step run on (``ClusterConfig.device`` or
    ``--device``): ``cpu``; ``cuda`` (``cuda:local_rank`` under torchrun, else the current
    CUDA device); ``cuda:N`` (under torchrun the rank's ``cuda:local_rank`` instead: one GPU
    per rank); None: ``cuda`` when ``torch.cuda.is_available()``, else ``cpu``.

    Raises ValueError naming the value when CUDA is asked for but not available, or the
    index is not a visible device.
    """
    if wanted is None:
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cpu":
        return torch.device("cpu")
    if re.fullmatch(r"cuda(:[0-9]+)?", wanted) is None:
        raise ValueError(f"device = {wanted!r}: expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"device = {wanted!r}, but CUDA is not available here "
                         f"(torch {torch.__version__}); use device: cpu")
    if local_rank is not None:
        index = local_rank
    elif wanted == "cuda":
        index = torch.cuda.current_device()
    else:
        index = int(wanted[5:])
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"device = {wanted!r}: cuda:{index} is not one of the "
                         f"{torch.cuda.device_count()} visible devices")
    return torch.device(f"cuda:{index}")


class ClusterTrainer:
    """A cluster's model, inner optimizer, batch source, gradient clip and counters.

    Args:
        cluster_id: the cluster (for error messages).
        model: FP32 model (:func:`dips.train.model.build_model`); optimizer: its inner AdamW
            (:func:`dips.train.loop.make_inner_optimizer`).  Several trainers may share both
            (virtual-time data parallel: replicas are identical by construction).
        batches: the cluster's :class:`BatchSource`.
        grad_clip: max global L2 norm of an inner step's gradient (> 0), or None.

    Counters: ``steps`` (batches trained on) and ``tokens`` (tokens trained on) since creation.
    Raises ValueError for a bad ``grad_clip``.
    """

    def __init__(self, cluster_id: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 batches: BatchSource, grad_clip: float | None) -> None:
        self.cluster_id = cluster_id
        self.model = model
        self.optimizer = optimizer
        self.batches = batches
        self.grad_clip = check_grad_clip(grad_clip)
        self.names = [n for n, _ in model.named_parameters()]
        self.params = [p for _, p in model.named_parameters()]
        self.n_params = sum(p.numel() for p in self.params)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.steps = 0
        self.tokens = 0
        self.last_tokens = 0

    @property
    def tokens_per_batch(self) -> int:
        """Tokens per inner step (tokens)."""
        return self.batches.tokens_per_batch

    def zero_grad(self) -> None:
        """Drop the accumulated gradients (set to None)."""
        self.optimizer.zero_grad(set_to_none=True)

    def accumulate(self, divide_by: int = 1) -> float:
        """Add the gradient of the next batch's loss (÷ ``divide_by``) to ``p.grad``; count it.

        Returns the (divided) loss, nats/token.  The batch source's NoData passes through with
        nothing consumed; FloatingPointError (non-finite loss) names the cluster and leaves
        the gradients and counters as they were.
        """
        batch = self.batches.next_batch()
        try:
            value = backward_loss(self.model, batch, divide_by)
        except FloatingPointError as exc:
            raise FloatingPointError(f"cluster {self.cluster_id}: step {self.steps + 1}: {exc}") from None
        self.steps += 1
        self.last_tokens = int(batch.shape[0]) * (int(batch.shape[1]) - 1)  # a last batch may be short
        self.tokens += self.last_tokens
        return value

    def apply(self) -> None:
        """Clip the accumulated gradient, take the optimizer step, zero the gradients."""
        optimizer_step(self.model, self.optimizer, self.grad_clip)

    def step(self, grad_hook: GradHook | None = None) -> StepResult:
        """One inner step (:func:`dips.train.loop.inner_step`) on the next batch.

        ``grad_hook`` (if given) runs between backward and the clip + optimizer step; its time
        is left out of ``compute_s``.  Raises what :meth:`accumulate` raises.
        """
        t0 = time.monotonic()
        self.zero_grad()
        loss = self.accumulate()
        hook_s = 0.0
        if grad_hook is not None:
            t = time.monotonic()
            grad_hook(self.params)
            hook_s = time.monotonic() - t
        self.apply()
        if self.device.type == "cuda":  # compute_s counts the kernels, not their launches
            torch.cuda.current_stream(self.device).synchronize()
        return StepResult(loss, self.last_tokens, time.monotonic() - t0 - hook_s)


def build_trainer(cluster_id: str, model: ModelConfig, data: DataConfig, inner: InnerConfig,
                  seed: int, *, assignment: Sequence[str] | None = None,
                  tokens: TokenData | None = None, cache_dir: Path | None = None,
                  share: ClusterTrainer | None = None,
                  device: torch.device | None = None) -> ClusterTrainer:
    """The trainer of cluster ``cluster_id`` from the typed spec (module docstring).

    Args:
        cluster_id: this cluster; model, data, inner, seed: the run's
            :class:`~dips.spec.ModelConfig`, :class:`~dips.spec.DataConfig`,
            :class:`~dips.spec.InnerConfig` and seed (model init and batch order).
        assignment: every cluster id of the run, in order: a fixed BatchSampler over
            ``cluster_id``'s round-robin share of the chunks (seed :func:`sampler_seed`);
            None: a LeaseSampler (seed ``seed``, ``data.lease_ahead`` chunks ahead).
        tokens: the token streams, if already loaded (virtual time builds many clusters);
            else loaded from ``cache_dir`` (default ``data.cache_dir``).
        share: another trainer whose model and optimizer this one uses (its own batches).
        device: where the model lives (:func:`resolve_device`; None: the host); the model is
            moved there before its optimizer is built, batches follow at each step.

    Raises:
        ValueError: ``cluster_id`` not in ``assignment``, fewer chunks than clusters, or a
            bad model/optimizer setting.
    """
    from dips.train.datasource import load_data
    from dips.train.lease import LeaseSampler
    from dips.train.sampler import BatchSampler, assign_chunks, make_chunks

    if tokens is None:
        tokens = load_data(data, cache_dir)
    chunks = make_chunks(len(tokens.train), data.num_chunks)
    batches: BatchSource
    if assignment is None:
        batches = LeaseSampler(tokens.train, chunks, inner.seq_len, inner.batch_size, seed=seed,
                               ahead=data.lease_ahead)
    else:
        owned = assign_chunks(data.num_chunks, list(assignment))
        if cluster_id not in owned:
            raise ValueError(f"cluster {cluster_id!r} is not in the assignment {list(assignment)}")
        batches = BatchSampler(tokens.train, chunks, owned[cluster_id], inner.batch_size,
                               inner.seq_len, seed=sampler_seed(seed, cluster_id))
    if share is not None:
        net, opt = share.model, share.optimizer
    else:
        from dips.train.loop import make_inner_optimizer
        from dips.train.model import build_model

        net = build_model(model, seed)
        if device is not None:
            net = net.to(device)
        opt = make_inner_optimizer(net, inner.lr, inner.weight_decay)
    return ClusterTrainer(cluster_id, net, opt, batches, inner.grad_clip)
