"""The inner loop of one cluster: AdamW inner steps and a deterministic validation loss.

Source: §13 of the seed (each cluster runs AdamW inner steps, lr 6e-5 there, tuned higher for
these small models; H inner steps between pushes, §5) and the PyTorch ``torch.optim.AdamW`` /
``torch.nn.functional.cross_entropy`` APIs.  Losses are mean next-token cross-entropy in
nats per token, computed here from the logits (not by HF's internal label shift).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["backward_loss", "check_grad_clip", "eval_loss", "eval_windows", "inner_step",
           "make_inner_optimizer", "model_device", "optimizer_step"]


def make_inner_optimizer(
    model: torch.nn.Module,
    lr: float,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters for inner steps (§13: inner optimizer is AdamW).

    Two parameter groups: matrices (``dim >= 2``, embeddings included) get ``weight_decay``;
    vectors (RMSNorm gains, biases) get none.  Uses ``fused=True`` (PyTorch's fused kernel, on
    CPU and CUDA alike: build the optimizer after the model moved to its device); falls back
    to ``foreach=True`` if the fused kernel is rejected for this device/dtype.

    Args:
        model: the module to optimize (FP32 parameters).
        lr: learning rate (> 0, finite); weight_decay: decoupled decay coefficient (>= 0).
        betas: (beta1, beta2), each in [0, 1).

    Raises:
        ValueError: bad ``lr``, ``weight_decay`` or ``betas`` (named with the value), or a
            model without trainable parameters.
    """
    if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr must be a finite float > 0, got {lr!r}")
    if not isinstance(weight_decay, (int, float)) or not math.isfinite(weight_decay) or weight_decay < 0:
        raise ValueError(f"weight_decay must be a finite float >= 0, got {weight_decay!r}")
    if len(tuple(betas)) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two floats in [0, 1), got {betas!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters")
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": float(weight_decay)},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    kwargs = dict(lr=float(lr), betas=(float(betas[0]), float(betas[1])))
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


def _check_tokens(model: torch.nn.Module, batch: torch.Tensor, name: str) -> None:
    """Validate a (B, T+1) integer token batch against the model's vocab and context."""
    if not isinstance(batch, torch.Tensor) or batch.dim() != 2 or batch.shape[0] < 1 or batch.shape[1] < 2:
        shape = tuple(batch.shape) if isinstance(batch, torch.Tensor) else type(batch).__name__
        raise ValueError(f"{name} must be a 2-D tensor (B, T+1) with B >= 1, T >= 1, got {shape}")
    if batch.dtype.is_floating_point or batch.dtype.is_complex or batch.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got dtype {batch.dtype}")
    cfg = model.config
    if batch.shape[1] - 1 > cfg.max_position_embeddings:
        raise ValueError(
            f"{name} sequence length {batch.shape[1] - 1} exceeds max_seq_len {cfg.max_position_embeddings}"
        )
    lo, hi = int(batch.min()), int(batch.max())
    if lo < 0 or hi >= cfg.vocab_size:
        raise ValueError(f"{name} holds token ids in [{lo}, {hi}], outside [0, {cfg.vocab_size})")


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (a DTensor's local device under FSDP2);
    ``cpu`` for a model without parameters."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _next_token_loss(model: torch.nn.Module, batch: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy (nats) of predicting ``batch[:, 1:]`` from ``batch[:, :-1]``; the batch
    (host or device, any integer dtype) moves to the model's device as int64 first."""
    batch = batch.to(device=model_device(model), dtype=torch.long, non_blocking=True)
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1), reduction=reduction
    )


def backward_loss(model: torch.nn.Module, batch: torch.Tensor, divide_by: int = 1) -> float:
    """Forward, mean next-token cross-entropy (÷ ``divide_by``), backward: gradients ADD up.

    The first half of an inner step, alone so that per-step data parallel can sum several
    batches' gradients into one step (virtual DP: one backward per cluster with
    ``divide_by = n``, the mean of the clusters' gradients) or hand them to an all-reduce
    before the optimizer step.  Puts the model in train mode; does not zero the gradients.

    Args:
        model: a model from :func:`dips.train.model.build_model`.
        batch: integer tensor (B, T+1) of token ids, T <= max_seq_len, ids in [0, vocab_size);
            checked where it is (a host batch on the host), then moved to the model's device.
        divide_by: the loss is divided by this before backward (1: not divided at all).

    Returns:
        The (divided) loss in nats per token (float).

    Raises:
        ValueError: malformed ``batch``.
        FloatingPointError: non-finite loss; nothing was added to the gradients.
    """
    _check_tokens(model, batch, "batch")
    model.train()
    loss = _next_token_loss(model, batch)
    if divide_by != 1:
        loss = loss / divide_by
    value = float(loss.detach())
    if not math.isfinite(value):
        raise FloatingPointError(f"inner_step loss is {value}; optimizer step skipped")
    loss.backward()
    return value


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   grad_clip: float | None) -> None:
    """The second half of an inner step: clip the global L2 norm to ``grad_clip`` (None: no
    clip), take the optimizer step, zero the gradients (set to None)."""
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), float(grad_clip))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def check_grad_clip(grad_clip: float | None) -> float | None:
    """``grad_clip`` if it is a number > 0 or None; else ValueError naming the value."""
    if grad_clip is not None and (not isinstance(grad_clip, (int, float)) or not grad_clip > 0):
        raise ValueError(f"grad_clip must be a float > 0 or None, got {grad_clip!r}")
    return grad_clip


def inner_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: torch.Tensor,
    grad_clip: float | None = 1.0,
) -> float:
    """One inner step: forward, mean next-token cross-entropy, backward, clip, AdamW step.

    Inputs are ``batch[:, :-1]`` and labels ``batch[:, 1:]``; the model is put in train mode.
    Costs ≈ 0.2–0.3 s for batch 8×128 on one thread with the default 1.25 M-parameter model.
    :meth:`dips.train.trainer.ClusterTrainer.step` is the same step with a batch source,
    counters and a gradient hook.

    Args:
        model: a model from :func:`dips.train.model.build_model`.
        optimizer: typically :func:`make_inner_optimizer`'s AdamW over ``model``.
        batch: integer tensor (B, T+1) of token ids (e.g. ``BatchSampler.next_batch()``),
            T <= max_seq_len, ids in [0, vocab_size).
        grad_clip: max global L2 norm of the gradient (> 0), or None for no clipping.

    Returns:
        The loss before the update, in nats per token (float).

    Raises:
        ValueError: malformed ``batch`` or ``grad_clip``.
        FloatingPointError: non-finite loss; the parameters are left unchanged.
    """
    check_grad_clip(grad_clip)
    optimizer.zero_grad(set_to_none=True)
    value = backward_loss(model, batch)
    optimizer_step(model, optimizer, grad_clip)
    return value


def eval_windows(n_tokens: int, seq_len: int, num_windows: int) -> np.ndarray:
    """Start offsets (int64) of up to ``num_windows`` evenly spaced, non-overlapping windows.

    Each window holds ``seq_len + 1`` tokens; starts are ``i * stride`` with
    ``stride = (n_tokens - seq_len - 1) // (n - 1)`` >= seq_len + 1, where
    ``n = min(num_windows, n_tokens // (seq_len + 1))``; the last window ends near the end.

    Raises:
        ValueError: ``n_tokens < seq_len + 1`` or non-positive ``seq_len``/``num_windows``.
    """
    width = seq_len + 1
    if seq_len < 1 or num_windows < 1:
        raise ValueError(f"seq_len and num_windows must be >= 1, got seq_len={seq_len!r}, num_windows={num_windows!r}")
    if n_tokens < width:
        raise ValueError(f"val has {n_tokens} tokens, fewer than seq_len+1={width}")
    n = min(num_windows, n_tokens // width)
    stride = (n_tokens - width) // (n - 1) if n > 1 else 0
    return np.arange(n, dtype=np.int64) * stride


@torch.no_grad()
def eval_loss(
    model: torch.nn.Module,
    val: np.ndarray,
    seq_len: int,
    batch_size: int = 16,
    max_batches: int = 8,
) -> float:
    """Mean next-token cross-entropy (nats/token) over fixed windows of the validation split.

    Uses the same ``min(batch_size * max_batches, len(val) // (seq_len+1))`` evenly spaced,
    non-overlapping windows on every call (:func:`eval_windows`), so repeated calls on the same
    weights return the same value.  The model runs in eval mode and its previous mode is
    restored.  At initialisation the loss is ≈ ln(vocab_size) (8.32 nats at vocab 4096).

    Args:
        model: a model from :func:`dips.train.model.build_model`.
        val: 1-D integer token ids (``TokenData.val``), ids < vocab_size.
        seq_len: tokens predicted per window (1 … max_seq_len).
        batch_size: windows per forward pass (> 0); max_batches: forward passes (> 0).

    Raises:
        ValueError: ``val`` not a 1-D integer array or shorter than ``seq_len + 1``; bad
            ``seq_len``, ``batch_size`` or ``max_batches``; ids outside the vocab.
    """
    val = np.asarray(val)
    if val.ndim != 1 or not np.issubdtype(val.dtype, np.integer):
        raise ValueError(f"val must be a 1-D integer array, got shape {val.shape} dtype {val.dtype}")
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("max_batches", max_batches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    starts = eval_windows(val.size, seq_len, batch_size * max_batches)
    index = starts[:, None] + np.arange(seq_len + 1, dtype=np.int64)[None, :]
    windows = torch.from_numpy(val[index].astype(np.int64))
    _check_tokens(model, windows, "val windows")
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        for lo in range(0, windows.shape[0], batch_size):
            total += float(_next_token_loss(model, windows[lo : lo + batch_size], reduction="sum"))
    finally:
        model.train(was_training)
    return total / (windows.shape[0] * seq_len)
