"""Inner AdamW steps and validation loss (dips.train.loop)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dips.train.corpus import BatchSampler, assign_chunks, make_chunks
from dips.train.loop import eval_loss, eval_windows, inner_step, make_inner_optimizer
from dips.train.model import build_model


def _fixed_loss(model, batch) -> float:
    with torch.no_grad():
        logits = model(input_ids=batch[:, :-1]).logits
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)))


def test_inner_steps_reduce_loss(tiny_cfg, tiny_tokens):
    train = tiny_tokens.train[:300_000]
    chunks = make_chunks(train.size, 32)
    sampler = BatchSampler(train, chunks, assign_chunks(32, ["a", "b"])["a"], 8, 32, seed=0)
    fixed = BatchSampler(train, chunks, [1], 8, 32, seed=9).next_batch()  # chunk of cluster "b"
    model = build_model(tiny_cfg, seed=0)
    opt = make_inner_optimizer(model, lr=1e-2)
    start = _fixed_loss(model, fixed)
    losses = [inner_step(model, opt, sampler.next_batch()) for _ in range(30)]
    end = _fixed_loss(model, fixed)
    assert all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(512)) < 0.3
    assert end < start - 0.5, (start, end)


def test_optimizer_groups_and_validation(tiny_cfg):
    model = build_model(tiny_cfg, seed=0)
    opt = make_inner_optimizer(model, lr=1e-3)
    decays = sorted(g["weight_decay"] for g in opt.param_groups)
    assert decays == [0.0, 0.1]
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="lr"):
        make_inner_optimizer(model, lr=0.0)
    with pytest.raises(ValueError, match="betas"):
        make_inner_optimizer(model, lr=1e-3, betas=(0.9, 1.0))


def test_inner_step_rejects_bad_batches(tiny_cfg):
    model = build_model(tiny_cfg, seed=0)
    opt = make_inner_optimizer(model, lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    for bad, field in (
        (torch.zeros(2, 9), "dtype"),
        (torch.zeros(9, dtype=torch.long), "2-D"),
        (torch.zeros(2, 66, dtype=torch.long), "max_seq_len"),
        (torch.full((2, 9), 512, dtype=torch.long), "outside"),
    ):
        with pytest.raises(ValueError, match=field):
            inner_step(model, opt, bad)
    with pytest.raises(ValueError, match="grad_clip"):
        inner_step(model, opt, torch.zeros(2, 9, dtype=torch.long), grad_clip=0.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_eval_loss_deterministic_near_uniform(tiny_cfg, tiny_tokens):
    model = build_model(tiny_cfg, seed=0)
    a = eval_loss(model, tiny_tokens.val, seq_len=32, batch_size=8, max_batches=2)
    b = eval_loss(model, tiny_tokens.val, seq_len=32, batch_size=8, max_batches=2)
    assert a == b
    assert abs(a - math.log(512)) < 0.2
    assert model.training
    model.eval()
    eval_loss(model, tiny_tokens.val, seq_len=32, batch_size=4, max_batches=1)
    assert not model.training
    with pytest.raises(ValueError, match="seq_len"):
        eval_loss(model, tiny_tokens.val[:10], seq_len=32)


def test_eval_windows_even_and_disjoint():
    starts = eval_windows(1000, 9, 50)
    assert starts.size == 50 and starts[0] == 0
    assert np.all(np.diff(starts) >= 10) and starts[-1] + 10 <= 1000
    assert eval_windows(25, 9, 50).tolist() == [0, 15]
    assert eval_windows(10, 9, 3).tolist() == [0]
