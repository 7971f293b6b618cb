"""Pipeline stages of a cluster (issue 14, ``parallel: pipeline``): the stage split, the
stage modules chained equal the whole model, and two gloo ranks running a GPipe schedule
take the same inner step, bit for bit up to float rounding, as one process holding the
whole model (tied embeddings: both copies of the shared matrix stay equal)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dips.emu.launcher import free_port
from dips.roles.layers import group_layers
from dips.train.model import build_model
from dips.train.pipeline import StageModule, _block_indices, stage_blocks

pytestmark = pytest.mark.timeout(120)

MODEL = {"arch": "llama", "hidden_size": 32, "intermediate_size": 64, "num_layers": 3,
         "num_heads": 4, "num_kv_heads": 2, "vocab_size": 64, "max_seq_len": 16}


def _keys(model: torch.nn.Module) -> list[str]:
    return [k for k, _ in group_layers(model)]


def test_stage_blocks_give_embed_to_the_first_stage_and_head_to_the_last():
    keys = ["embed", "layers.0", "layers.1", "layers.2", "head"]
    assert stage_blocks(keys, 2) == [range(0, 2), range(2, 5)]
    assert stage_blocks(keys, 3) == [range(0, 2), range(2, 3), range(3, 5)]
    with pytest.raises(ValueError, match="3 decoder blocks for 4 stages"):
        stage_blocks(keys, 4)
    with pytest.raises(ValueError, match="expected embed"):
        stage_blocks(["layers.0", "head"], 2)


@pytest.mark.parametrize("stages", [2, 3])
def test_stage_modules_chained_equal_the_whole_model(stages):
    model = build_model(MODEL, seed=1).eval()
    blocks = stage_blocks(_keys(model), stages)
    parts = [StageModule(model, _block_indices(b, stages, i), i, stages)
             for i, b in enumerate(blocks)]
    x = torch.randint(0, 64, (3, 16))
    h = x
    with torch.no_grad():
        for part in parts:
            h = part(h)
        whole = model(input_ids=x, use_cache=False).logits
    torch.testing.assert_close(h, whole, rtol=0, atol=1e-5)


def test_a_model_of_another_layout_is_refused():
    gpt2 = build_model({"arch": "hf", "vocab_size": 64, "hf_config": {
        "model_type": "gpt2", "n_embd": 16, "n_layer": 2, "n_head": 2, "n_positions": 16}},
        seed=0)
    with pytest.raises(ValueError, match="LLaMA-family"):
        StageModule(gpt2, range(0, 1), 0, 2)


class _Batches:
    """Always the same batch (a stand-in for the cluster's LeaseSampler)."""

    batch_size, seq_len = 4, 16

    def __init__(self, batch: torch.Tensor) -> None:
        self.batch = batch

    def next_windows(self, n: int) -> list[tuple[int, int]]:
        return [(0, i) for i in range(n)]

    def read(self, windows: list) -> torch.Tensor:
        return self.batch[:len(windows)]


def _rank(rank: int, port: int, batch: torch.Tensor, out: dict) -> None:
    from dips.roles.rank_comm import Ranks
    from dips.train.ddp import RankSampler
    from dips.train.loop import make_inner_optimizer
    from dips.train.pipeline import PipeTrainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    try:
        ranks = Ranks.control_group(rank, 2, 60.0, torch.device("cpu"))
        model = build_model(MODEL, seed=1)
        trainer = PipeTrainer("p", model, stage_blocks(_keys(model), 2),
                              lambda m: make_inner_optimizer(m, 0.01), RankSampler(
                                  _Batches(batch), 0, 1), 0.05, ranks, microbatches=2)
        losses = [trainer.step().loss for _ in range(2)]
        out[rank] = {"losses": losses, "tokens": trainer.tokens,
                     "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    finally:
        dist.destroy_process_group()


def test_two_stage_ranks_take_the_inner_steps_of_one_process():
    from dips.train.loop import inner_step, make_inner_optimizer

    batch = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(3))
    with mp.Manager() as manager:
        out = manager.dict()
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, batch, out)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            for p in procs:
                p.join(100)
            assert [p.exitcode for p in procs] == [0, 0]
            got = dict(out)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
    model = build_model(MODEL, seed=1)
    opt = make_inner_optimizer(model, 0.01)
    want = [inner_step(model, opt, batch, grad_clip=0.05) for _ in range(2)]
    assert got[0]["losses"] == got[1]["losses"]
    assert got[0]["losses"] == pytest.approx(want, rel=1e-5)
    assert got[0]["tokens"] == 2 * 4 * 16  # every microbatch counted once, on every rank
    blocks = stage_blocks(_keys(model), 2)
    keys = _keys(model)
    for name, p in model.named_parameters():
        layer = next(k for k, ps in group_layers(model) if any(n == name for n, _ in ps))
        owner = next(r for r, b in enumerate(blocks) if keys.index(layer) in b)
        # Adam divides by sqrt(v): where a gradient is near zero, float rounding of the
        # microbatches' sum can move an element by up to lr a step. So: every element within
        # Adam's bound (2 steps x lr 0.01), and all but a few within rounding.
        diff = (got[owner]["params"][name] - p.detach()).abs()
        assert diff.max() <= 2 * 0.01 + 1e-6, (name, diff.max())
        close = torch.isclose(got[owner]["params"][name], p.detach(), rtol=1e-4, atol=1e-6)
        assert close.float().mean() >= 0.995, (name, int((~close).sum()), diff.max())
    tied = "model.embed_tokens.weight"  # the last stage's replica of the tied matrix
    assert torch.equal(got[0]["params"][tied], got[1]["params"][tied])
