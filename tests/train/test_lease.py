"""LeaseSampler: windows follow the ledger's positions, never leave the held chunks."""

import numpy as np
import pytest

from dips.train.lease import LeaseSampler, NoData


def _sampler(**kw):
    tokens = np.arange(1000, dtype=np.int64)
    chunks = [(0, 250), (250, 500), (500, 750), (750, 1000)]
    return LeaseSampler(tokens, chunks, seq_len=9, batch_size=4, seed=3, **kw)


def test_windows_come_from_held_chunks_in_a_fixed_order():
    s = _sampler()
    assert s.windows_per_chunk == 25
    s.set_holdings([(1, 0)])
    b = s.next_batch().numpy()
    assert b.shape == (4, 10)
    assert ((b >= 250) & (b < 500)).all()
    assert (np.diff(b, axis=1) == 1).all()          # contiguous windows of T+1 tokens
    assert s.positions() == {1: 4}
    other = _sampler()                               # another cluster resuming chunk 1 at 2
    other.set_holdings([(1, 2)])
    assert (other.next_batch().numpy()[:2] == b[2:]).all()


def test_rewind_and_merge():
    s = _sampler()
    s.set_holdings([(0, 0)])
    s.next_batch()
    s.merge_holdings([(0, 0), (2, 5)])               # a lease keeps local progress
    assert s.positions() == {0: 4, 2: 5}
    s.set_holdings([(0, 0), (2, 5)])                 # a rejected push rewinds
    assert s.positions() == {0: 0, 2: 5}


def test_no_data_and_wanted():
    s = _sampler(ahead=2)
    assert s.wanted() == 2
    with pytest.raises(NoData):
        s.next_batch()
    s.set_holdings([(3, 23)])
    assert s.wanted() == 1 and s.available() == 2
    with pytest.raises(NoData):
        s.next_batch()
    assert s.positions() == {3: 23}                  # nothing consumed
    with pytest.raises(ValueError, match="chunk=9"):
        s.set_holdings([(9, 0)])


def test_draining_trains_the_last_windows_in_a_short_batch():
    s = _sampler()
    s.set_holdings([(3, 23)])                        # 2 windows left, a batch needs 4
    s.drain = True
    b = s.next_batch()
    assert tuple(b.shape) == (2, 10) and s.positions() == {3: 25} and not s.drain
    with pytest.raises(NoData):                      # nothing left: draining gives nothing
        s.drain = True
        s.next_batch()
