"""A cluster as a torchrun job of pipeline stages (issue 14; §5, §10 of the seed).

With ``parallel: pipeline`` the ranks of a multi-rank cluster are the stages of one model
(``torch.distributed.pipelining``: a :class:`~torch.distributed.pipelining.PipelineStage` per
rank and a :class:`~torch.distributed.pipelining.ScheduleGPipe` over ``microbatches``): rank
r runs the decoder blocks :func:`stage_blocks` gives it, the first stage also the embedding,
the last the final norm and the LM head. Each stage rank is the stage worker of exactly its
own layers (§5, §10: "each pipeline stage pushes and pulls its own layers"), so the
followers see one data connection per stage.

* Data (§12): every rank keeps the cluster's sampler state (rank 0's, as in DDP mode) and
  reads the whole batch; the first stage feeds the inputs, the last the targets. A step
  consumes ``batch_size`` windows whatever the stages and microbatches, so the tokens of a
  sync interval (T_j) are what all its microbatches consumed: H × batch_size × seq_len.
* Inner step: a batch shorter than ``batch_size`` (the last one when data runs out) is padded
  to it with rows whose targets are ignored (every microbatch keeps one shape); each
  microbatch's loss is its summed cross-entropy ÷ the batch's real tokens, so the gradients
  of the microbatches add up to that of the batch's mean loss. The loss is broadcast from
  the last stage; a non-finite one stops every rank before the optimizer step. The gradient
  is clipped by its global L2 norm over all stages (an all-reduce of squared norms).
* Tied embeddings (LLaMA's ``tie_word_embeddings``): the shared matrix is the layer
  ``embed``, owned (pushed and pulled) by the first stage; the last stage holds a replica for
  its LM head. Both add the other's gradient every inner step (an all-reduce on a group of
  the two ranks), so their AdamW steps are identical and so are the two copies; after a
  pull the owner's value is broadcast to every rank with the rest of the model.

Supported models: LLaMA-family decoders (``model.embed_tokens``, ``model.layers``,
``model.norm``, ``model.rotary_emb``, ``lm_head``: LLaMA, Qwen3, Mistral of
:func:`dips.train.model.build_model` or ``arch: hf``) with SDPA attention (causal without a
mask). Each rank builds the whole model (every rank holds the complete model after a pull,
so the replicas' checksums can be compared) but trains only its stage.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dips.roles.rank_comm import Ranks
from dips.train.ddp import RankSampler, split_rows
from dips.train.loop import _check_tokens
from dips.train.trainer import ClusterTrainer

__all__ = ["PipeTrainer", "StageModule", "pipeline_trainer", "stage_blocks"]

#: Target id of padding rows (ignored by the loss).
IGNORE = -100


def stage_blocks(keys: list[str], world: int) -> list[range]:
    """Layer indices of each stage (rank r runs stage r): the decoder blocks split into
    ``world`` contiguous runs of equal count (differing by at most one), ``embed`` (index 0)
    added to the first stage and ``head`` (the last index) to the last.

    Args: keys: the model's layer keys in model order (``embed``, ``layers.0`` …
    ``layers.{L-1}``, ``head``; :func:`dips.roles.layers.group_layers`); world: stages (>= 2).
    Raises ValueError (naming the values) for another layout or fewer blocks than stages.
    """
    n = len(keys) - 2
    if world < 2 or keys[:1] != ["embed"] or keys[-1:] != ["head"] or \
            keys[1:-1] != [f"layers.{i}" for i in range(n)]:
        raise ValueError(f"parallel = 'pipeline': layers {keys} with world = {world}: expected "
                         "embed, layers.0 … layers.{L-1}, head and world >= 2")
    if n < world:
        raise ValueError(f"parallel = 'pipeline': {n} decoder blocks for {world} stages "
                         "(num_layers must be >= WORLD_SIZE)")
    out = []
    for r in range(world):
        share = split_rows(n, world, r)
        out.append(range(0 if r == 0 else share.start + 1,
                         n + 2 if r == world - 1 else share.stop + 1))
    return out


class StageModule(torch.nn.Module):
    """Stage ``index`` of ``stages`` of a LLaMA-family causal LM (module docstring): the
    submodules of ``model`` it runs (shared, not copied) and a forward from its input to its
    output.

    Input: ``(mb, T)`` int64 token ids on the first stage, else ``(mb, T, hidden)`` float
    hidden states. Output: ``(mb, T, vocab)`` float logits on the last stage, else
    ``(mb, T, hidden)`` hidden states. ``blocks``: the indices of its decoder blocks.
    Raises ValueError for a model without that layout (parameter ``parallel``).
    """

    def __init__(self, model: torch.nn.Module, blocks: range, index: int, stages: int) -> None:
        super().__init__()
        base = getattr(model, "model", None)
        need = ("embed_tokens", "layers", "norm", "rotary_emb")
        if base is None or not hasattr(model, "lm_head") or \
                not all(hasattr(base, a) for a in need):
            raise ValueError(f"parallel = 'pipeline' needs a LLaMA-family model (model."
                             f"embed_tokens, model.layers, model.norm, model.rotary_emb, "
                             f"lm_head); {type(model).__name__} is not one")
        self.first, self.last = index == 0, index == stages - 1
        self.embed = base.embed_tokens if self.first else None
        self.blocks = torch.nn.ModuleList([base.layers[i] for i in blocks])
        self.rotary = base.rotary_emb
        self.norm = base.norm if self.last else None
        self.head = model.lm_head if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        pe = self.rotary(h, position_ids=pos)
        for block in self.blocks:
            h = block(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
        if self.head is None:
            return h
        return self.head(self.norm(h))


class PipeTrainer(ClusterTrainer):
    """A :class:`~dips.train.trainer.ClusterTrainer` whose inner step runs this rank's stage
    of a GPipe schedule (module docstring).

    Args:
        cluster_id; model: the whole model (its layer table is the cluster's);
        blocks: :func:`stage_blocks` over ``model``'s layers (the same on every rank);
        optimizer_for: builds the inner AdamW over a module (this rank's stage);
        batches: a :class:`~dips.train.ddp.RankSampler` of world 1 (every rank reads the
        whole batch); grad_clip: global L2 norm (> 0) or None; ranks: this rank's Ranks;
        microbatches: GPipe microbatches per inner step (1 ..= batch_size).

    ``steps``/``tokens`` count the cluster's; returned losses are the batch's mean
    (nats/token) on every rank. Raises ValueError for a bad ``microbatches`` or layout,
    FloatingPointError on every rank for a non-finite loss (nothing applied).
    """

    def __init__(self, cluster_id: str, model: torch.nn.Module, blocks: list[range],
                 optimizer_for: Any, batches: RankSampler, grad_clip: float | None,
                 ranks: Ranks, microbatches: int) -> None:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        if not 1 <= microbatches <= batches.batch_size:
            raise ValueError(f"microbatches = {microbatches}: must be in [1, batch_size = "
                             f"{batches.batch_size}]")
        stage = StageModule(model, _block_indices(blocks[ranks.rank], len(blocks), ranks.rank),
                            ranks.rank, ranks.world)
        super().__init__(cluster_id, model, optimizer_for(stage), batches, grad_clip)
        self.stage, self.ranks, self.microbatches = stage, ranks, microbatches
        self.rows = math.ceil(batches.batch_size / microbatches) * microbatches
        self._real_tokens = 1
        self.schedule = ScheduleGPipe(
            PipelineStage(stage, ranks.rank, ranks.world, ranks.device), microbatches,
            loss_fn=self._loss, scale_grads=False)
        self.own = [p for p in stage.parameters()]
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        self.tied = emb is not None and head is not None and emb.weight is head.weight
        # every rank creates the group (new_group is a collective), only its two ranks use
        # it; the default group's backends (the gradient's device decides: gloo or NCCL)
        self.tied_group = dist.new_group([0, ranks.world - 1], timeout=timedelta(
            seconds=ranks.timeout_s)) if self.tied else None
        self.tied_param = emb.weight if self.tied else None
        # the last stage's tied replica is counted once in the global norm (on the first)
        self.norm_params = [p for p in self.own if not (
            self.tied and stage.last and not stage.first and p is self.tied_param)]

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """One microbatch's summed cross-entropy ÷ the batch's real target tokens."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               target.reshape(-1), ignore_index=IGNORE,
                               reduction="sum") / self._real_tokens

    def accumulate(self, divide_by: int = 1) -> float:
        if divide_by != 1:
            raise ValueError(f"PipeTrainer: divide_by = {divide_by} (gradient accumulation "
                             "across batches is not supported in pipeline mode)")
        batch = self.batches.next_batch()
        _check_tokens(self.model, batch, "batch")
        real = int(batch.shape[0])
        if real < self.rows:  # a short last batch: pad with ignored rows (fixed shapes)
            batch = torch.cat([batch, batch[:1].expand(self.rows - real, -1)])
        device = self.ranks.device
        inputs = batch[:, :-1].to(device)
        target = batch[:, 1:].clone()
        target[real:] = IGNORE
        self._real_tokens = real * int(target.shape[1])
        self.stage.train()
        losses: list[torch.Tensor] = []
        if self.stage.first:
            self.schedule.step(inputs)
        elif self.stage.last:
            self.schedule.step(target=target.to(device), losses=losses)
        else:
            self.schedule.step()
        value = torch.zeros(1, dtype=torch.float64)
        if self.stage.last:
            value[0] = float(sum(float(l.detach()) for l in losses))
        dist.broadcast(value, src=self.ranks.world - 1, group=self.ranks.control)
        loss = float(value.item())
        if not math.isfinite(loss):
            self.zero_grad()
            raise FloatingPointError(f"cluster {self.cluster_id}: step {self.steps + 1}: "
                                     f"inner_step loss is {loss}; optimizer step skipped")
        self.steps += 1
        self.last_tokens = self._real_tokens
        self.tokens += self.last_tokens
        return loss

    def apply(self) -> None:
        """Sum the tied matrix's gradient over its two stages, clip the global norm over
        every stage, take this stage's AdamW step, zero the gradients."""
        if self.tied and (self.stage.first or self.stage.last):
            grad = self.tied_param.grad
            if grad is None:
                grad = self.tied_param.grad = torch.zeros_like(self.tied_param)
            dist.all_reduce(grad, group=self.tied_group)
        if self.grad_clip is not None:
            sq = torch.zeros(1, dtype=torch.float64, device=self.ranks.device)
            for p in self.norm_params:
                if p.grad is not None:
                    sq += p.grad.detach().double().pow(2).sum()
            dist.all_reduce(sq)  # the data group: the parameters' device
            coef = float(self.grad_clip) / (math.sqrt(float(sq.item())) + 1e-6)
            if coef < 1.0:
                for p in self.own:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _block_indices(layers: range, stages: int, index: int) -> range:
    """The decoder-block indices of a stage's layer range (layer i + 1 is block i)."""
    start = layers.start if index > 0 else 1
    stop = layers.stop if index < stages - 1 else layers.stop - 1
    return range(start - 1, stop - 1)


def pipeline_trainer(cluster_id: str, model: torch.nn.Module, layers: list, batches: Any,
                     inner: Any, ranks: Ranks, microbatches: int | None
                     ) -> tuple[PipeTrainer, list[range]]:
    """This rank's :class:`PipeTrainer` and the stages' layer ranges (:func:`stage_blocks`,
    the blocks of :class:`dips.roles.cluster_ranks.RankWorker`).

    Args: model: the whole model on ``ranks.device``; layers: its
    :func:`dips.roles.layers.group_layers`; batches: the cluster's LeaseSampler; inner: the
    run's InnerConfig (lr, weight_decay, grad_clip); microbatches: the cluster config's
    (None: one per stage, at most ``inner.batch_size``).
    Raises ValueError as :func:`stage_blocks` and :class:`PipeTrainer`.
    """
    from dips.train.loop import make_inner_optimizer

    blocks = stage_blocks([k for k, _ in layers], ranks.world)
    sampler = RankSampler(batches, 0, 1)  # every stage reads the cluster's whole batch
    count = microbatches or min(ranks.world, sampler.batch_size)
    trainer = PipeTrainer(cluster_id, model, blocks, lambda m: make_inner_optimizer(
        m, inner.lr, inner.weight_decay), sampler, inner.grad_clip, ranks, count)
    return trainer, blocks
