"""The inner AdamW state of a pipeline cluster (issue 14, ``InnerStateStore`` mode "pipeline"),
between two real gloo ranks: each stage rank's optimizer holds only its own stage's
parameters (the tied embedding on the first and the last stage), every rank saves its part
with torch.distributed.checkpoint into one payload, and

* a fresh optimizer of each stage loads back exactly its moments and step;
* the payload holds every parameter's state once, whatever stage held it;
* the state is found by parameter name: ranks that split the stages otherwise at the restart
  each load the state of the parameters they now hold;
* a DCP state of another layout (FSDP2) or a damaged pointer is refused on every rank, and
  then neither the optimizer nor the files change.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.train.ranks import run_ranks

pytestmark = pytest.mark.timeout(120)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 6)
        self.mid = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.head = nn.Linear(6, 12, bias=False)
        self.head.weight = self.embed.weight  # tied, as LLaMA's tie_word_embeddings


def _stage(model: Net, split: int, rank: int) -> list[nn.Parameter]:
    """Rank 0: the embedding and the first ``split`` blocks; rank 1: the rest and the head
    (the tied matrix again)."""
    blocks = list(model.mid)[:split] if rank == 0 else list(model.mid)[split:]
    params = [model.embed.weight] if rank == 0 else []
    params += [p for b in blocks for p in b.parameters()]
    return params + ([model.head.weight] if rank == 1 else [])


def _states(opt: torch.optim.Optimizer, model: Net) -> dict[str, dict[str, torch.Tensor]]:
    name = {id(p): n for n, p in model.named_parameters()}
    return {name[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _rank(rank: int, tmp: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from dips.roles.cluster_state import InnerStateError, InnerStateStore
    from dips.roles.rank_comm import Ranks
    from dips.train.loop import make_inner_optimizer

    out = Path(tmp)
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    try:
        ranks = Ranks.control_group(rank, 2, 60.0, torch.device("cpu"))
        torch.manual_seed(0)
        model = Net()

        def optimizer(params: list, lr: float = 1e-2) -> torch.optim.Optimizer:
            return make_inner_optimizer(nn.ParameterList(params), lr=lr)

        opt = optimizer(_stage(model, 2, rank))
        for step in range(3):  # the same gradient of the tied matrix on both stages
            for p in _stage(model, 2, rank):
                p.grad = torch.sin(p.detach() * (step + 1))
            opt.step()
            opt.zero_grad()
        saved = _states(opt, model)
        store = InnerStateStore(out / "inner", "p", model, opt, "pipeline", ranks)
        assert store.save(4, {"held": [[1, 5]]}, {"steps": 3, "tokens": 300}) is not None or \
            rank != 0
        report: dict = {"digests": store.digests()}

        fresh = optimizer(_stage(model, 2, rank), lr=5e-3)
        meta = InnerStateStore(out / "inner", "p", model, fresh, "pipeline", ranks).load()
        got = _states(fresh, model)
        report["meta"] = {k: meta[k] for k in ("version", "mode", "storage", "world", "counters")}
        report["exact"] = got.keys() == saved.keys() and all(
            torch.equal(got[n][k], saved[n][k]) for n in saved for k in saved[n])
        report["lr"] = [g["lr"] for g in fresh.param_groups]

        # Another split of the stages at the restart: each rank finds what it holds now.
        other = optimizer(_stage(model, 1, rank))
        InnerStateStore(out / "inner", "p", model, other, "pipeline", ranks).load()
        everyone = [None, None]
        dist.all_gather_object(everyone, {n: {k: v.tolist() for k, v in s.items()}
                                          for n, s in saved.items()})
        both = {n: s for part in everyone for n, s in part.items()}
        moved = _states(other, model)
        report["resplit"] = bool(moved) and all(
            torch.equal(moved[n][k], torch.tensor(both[n][k], dtype=moved[n][k].dtype))
            for n in moved for k in moved[n])

        # Another layout's DCP state, then a damaged pointer: refused, nothing changes.
        refused = []
        before = _files(out / "inner")
        untouched = optimizer(_stage(model, 2, rank))
        try:
            InnerStateStore(out / "inner", "p", model, untouched, "fsdp2", ranks).load()
        except InnerStateError as exc:
            refused.append(str(exc))
        if rank == 0:
            pointer = out / "inner" / "current.json"
            raw = pointer.read_bytes()
            pointer.write_text(json.dumps(dict(json.loads(raw), cluster_id="q")))
        ranks.gather({})  # the pointer is rewritten before anyone reads it
        try:
            InnerStateStore(out / "inner", "p", model, untouched, "pipeline", ranks).load()
        except InnerStateError as exc:
            refused.append(str(exc))
        if rank == 0:
            pointer.write_bytes(raw)
        ranks.gather({})
        after = _files(out / "inner")
        report.update(refused=refused, untouched=not untouched.state, files=before == after)
        (out / f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def test_each_pipeline_stage_saves_and_resumes_its_own_inner_state(tmp_path):
    from dips.roles.cluster_state import read_saved, state_digest

    run_ranks(_rank, [(r, str(tmp_path)) for r in range(2)], timeout_s=100)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rep in reports:
        assert rep["exact"] and rep["resplit"] and set(rep["lr"]) == {5e-3}
        assert rep["meta"] == {"version": 4, "mode": "pipeline", "storage": "dcp", "world": 2,
                               "counters": {"steps": 3, "tokens": 300}}
        assert len(rep["refused"]) == 2, rep["refused"]
        assert "field 'mode' = 'pipeline'" in rep["refused"][0]
        assert "field 'cluster_id' = 'q'" in rep["refused"][1]
        assert rep["untouched"] and rep["files"]
    meta, saved = read_saved(tmp_path / "inner")
    names = {n for n, _ in Net().named_parameters()}
    assert set(saved) == set(meta["params"]) == names  # every stage's part, the tied one once
    # Each stage's digest (gathered: one per rank) is that of its part of the payload.
    digests = reports[0]["digests"]
    assert digests == reports[1]["digests"] and digests[0] != digests[1]
    stage0 = {"embed.weight", "mid.0.weight", "mid.0.bias", "mid.1.weight", "mid.1.bias"}
    stage1 = {"embed.weight", "mid.2.weight", "mid.2.bias"}
    assert digests == [state_digest({n: saved[n] for n in stage0}),
                       state_digest({n: saved[n] for n in stage1})]
