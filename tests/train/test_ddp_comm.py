"""The in-cluster collectives of a multi-rank cluster (dips.roles.rank_comm) between two real
gloo processes: JSON control messages (never pickled) broadcast and all-gathered, a stop flag
any rank may raise, and parameters broadcast from their owner in buckets (split by size and
dtype) that leave every rank with the owner's exact values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.train.ranks import run_ranks

pytestmark = pytest.mark.timeout(120)


def _rank(rank: int, store: str, out: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from dips.roles.rank_comm import Ranks, broadcast_params

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        ranks = Ranks.control_group(rank, 2, 60.0, torch.device("cpu"))
        got = ranks.broadcast({"op": "push", "plans": [["embed", 0]], "é": "ü"} if rank == 0
                              else None)
        gathered = ranks.gather({"rank": rank, "pad": "x" * (rank * 100)})
        flags = [ranks.any(rank == 1), ranks.any(False)]
        gen = torch.Generator().manual_seed(rank)  # different values on each rank
        params = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen),
                  torch.randn(2, 2, generator=gen).to(torch.bfloat16),
                  torch.randn(40, generator=gen)]
        broadcast_params(params, src=1, bucket_bytes=100)  # several buckets
        digest = [t.float().sum().item() for t in params] + [params[0][1, 2].item()]
        Path(out).write_text(json.dumps({"got": got, "gathered": gathered, "flags": flags,
                                         "digest": digest}))
    finally:
        dist.destroy_process_group()


def test_control_messages_and_parameter_broadcast_between_two_ranks(tmp_path):
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    run_ranks(_rank, [(r, str(tmp_path / "store"), str(outs[r])) for r in range(2)])
    r0, r1 = (json.loads(o.read_text()) for o in outs)
    assert r0["got"] == r1["got"] == {"op": "push", "plans": [["embed", 0]], "é": "ü"}
    assert r0["gathered"] == r1["gathered"] == [{"rank": 0, "pad": ""},
                                                {"rank": 1, "pad": "x" * 100}]
    assert r0["flags"] == r1["flags"] == [True, False]
    assert r0["digest"] == r1["digest"]  # rank 1's values everywhere


class _Worker:
    """Rank ≥ 1's side of rank 0's commands (RankWorker.serve): here only ``end``."""

    def __init__(self, ranks) -> None:
        self.ranks = ranks

    def serve(self) -> dict:
        return self.ranks.broadcast(None)


class _Sampler:
    def state(self) -> dict:
        return {"held": [], "drain": False}

    def load_state(self, state: dict) -> None:
        assert state == {"held": [], "drain": False}


class _HoldingLead:
    """Rank 0's DiPSSync: its client holds for three ticks (start, a try, the end)."""

    def __init__(self, ranks) -> None:
        self.ticks = [{"event": "hold", "reason": "sync overdue"}, {}, {"event": "hold_end"}]
        lead = self

        class Client:
            finished = ""

            @property
            def holding(self) -> bool:
                return bool(lead.ticks)

            def held(self):
                return None

            def end(self, state: dict) -> None:
                ranks.broadcast({"op": "end", **state})

        self.client = Client()

    def held(self, trainer, stop):
        return self.ticks.pop(0) if self.ticks else None


def _rank_hold(rank: int, store: str, out: str) -> None:
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from dips.roles.rank_comm import Ranks
    from dips.train.ddp import RankSync

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        ranks = Ranks.control_group(rank, 2, 60.0, torch.device("cpu"))
        most = [ranks.most(3 if rank == 1 else 1), ranks.most(0)]
        sync = RankSync(ranks, _Worker(ranks), _Sampler(), _HoldingLead(ranks) if rank == 0
                        else None)
        seen, steps, stop = [], 0, threading.Event()
        while steps < 2 and sync.before_step(None, stop):
            fields = sync.held(None, stop)
            if fields is not None:
                seen.append(fields)
                continue
            steps += 1
            seen.append("step")
        Path(out).write_text(json.dumps({"most": most, "seen": seen}))
    finally:
        dist.destroy_process_group()


def test_every_rank_waits_out_rank_0s_hold_in_step(tmp_path):
    """Review 15, #2: a torchrun cluster's rank 0 holds (it cannot sync); every rank skips
    the same steps, tick by tick, and trains again with it."""
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    run_ranks(_rank_hold, [(r, str(tmp_path / "store"), str(outs[r])) for r in range(2)])
    got = [json.loads(o.read_text()) for o in outs]
    assert got[0]["most"] == got[1]["most"] == [3, 0]
    assert got[0]["seen"] == got[1]["seen"] == [
        {"event": "hold", "reason": "sync overdue"}, {}, {"event": "hold_end"}, "step", "step"]
