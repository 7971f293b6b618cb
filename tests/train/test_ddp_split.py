"""The splits of a multi-rank (DDP) cluster (issue 14): layers among ranks as stage workers,
balanced by bytes as one process's stages are; a step's windows among ranks, disjoint, the
same windows a one-process cluster of the same total batch would take, tokens summed."""

from __future__ import annotations

import numpy as np
import pytest

from dips.algo import partition_contiguous
from dips.roles.cluster_ranks import rank_blocks
from dips.train.ddp import RankSampler, split_rows
from dips.train.lease import LeaseSampler, NoData


def test_rank_blocks_are_the_stage_partition_and_extra_ranks_own_nothing():
    sizes = [400, 100, 100, 100, 100, 300]  # embed, 4 blocks, head (bytes)
    assert rank_blocks(sizes, 2) == partition_contiguous(sizes, 2) == [range(0, 3), range(3, 6)]
    blocks = rank_blocks(sizes, 3)
    assert [i for r in blocks for i in r] == list(range(6))  # contiguous, every layer once
    assert max(sum(sizes[i] for i in r) for r in blocks) == 400
    assert rank_blocks(sizes, 8) == [range(i, i + 1) for i in range(6)]  # ranks 6, 7: none
    with pytest.raises(ValueError):
        rank_blocks(sizes, 0)
    with pytest.raises(ValueError):
        rank_blocks([], 2)


@pytest.mark.parametrize("n,world", [(8, 2), (7, 3), (2, 4), (0, 2), (13, 5)])
def test_split_rows_is_a_partition_of_the_step(n, world):
    parts = [split_rows(n, world, r) for r in range(world)]
    assert [i for p in parts for i in p] == list(range(n))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ValueError):
        split_rows(n, world, world)


def _lease(seed: int = 3, batch: int = 2) -> LeaseSampler:
    tokens = np.arange(10 * 50, dtype=np.int64)  # 10 chunks of 50 tokens: 5 windows of 10
    chunks = [(i * 50, (i + 1) * 50) for i in range(10)]
    s = LeaseSampler(tokens, chunks, seq_len=9, batch_size=batch, seed=seed)
    s.set_holdings([(1, 0), (4, 2)])  # 5 + 3 = 8 windows
    return s


def test_ranks_train_disjoint_shares_of_what_one_process_would_train():
    world = 2
    ranks = [RankSampler(_lease(batch=4), r, world) for r in range(world)]
    single = _lease(batch=4)  # one process taking the cluster's whole step
    assert ranks[0].batch_size == single.batch_size == 4
    assert ranks[0].tokens_per_batch == single.tokens_per_batch == 36
    for _ in range(2):  # 8 windows: two steps of 4
        whole = single.next_batch()
        got = [s.next_batch() for s in ranks]
        assert all(s.last_total == 4 and s.last_mine == 2 for s in ranks)
        assert np.array_equal(np.concatenate([g.numpy() for g in got]), whole.numpy())
        assert ranks[0].positions() == ranks[1].positions() == single.positions()
    for s in ranks:
        with pytest.raises(NoData):
            s.next_batch()
    assert ranks[0].state() == {"held": [[1, 5], [4, 5]], "drain": False}


def test_a_short_last_step_is_split_and_a_rank_without_rows_gets_weight_zero():
    world = 3
    ranks = [RankSampler(_lease(batch=6), r, world) for r in range(world)]  # 6 of 8 windows
    for s in ranks:
        s.next_batch()
    for s in ranks:
        s.drain = True  # what DiPSSync.starved sets on rank 0; the `end` message carries it
    rows = [s.next_batch() for s in ranks]  # the last 2 windows among 3 ranks
    assert [s.last_mine for s in ranks] == [0, 1, 1] and ranks[0].last_total == 2
    assert rows[0].shape[0] == 1  # a stand-in window, weighted 0 by RankTrainer
    assert not ranks[0].drain and ranks[0].available() == 0


def test_other_ranks_adopt_rank_zeros_data_position_exactly():
    lead, other = RankSampler(_lease(), 0, 2), RankSampler(_lease(), 1, 2)
    lead.merge_holdings([(1, 0), (4, 2), (7, 0)])  # a lease only rank 0 made
    lead.next_batch()
    other.load_state(lead.state())
    assert other.positions() == lead.positions() and other.available() == lead.available()
