"""The data-chunk ledger: no window lost, none accepted twice, across joins, leaves,
rejections and crashes (DESIGN.md invariant; §12 of the seed)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dips.algo.ledger import ChunkLedger, LedgerError


def test_accepted_push_advances_rejected_push_rewinds():
    led = ChunkLedger(num_chunks=4, windows_per_chunk=10)
    assert led.lease("a", 2) == [(0, 0), (1, 0)]
    led.report("a", {0: 10, 1: 3})
    assert led.resolve("a", accepted=True) == 13
    assert led.holdings("a") == [(1, 3)]           # chunk 0 finished, 1 resumes at 3
    led.report("a", {1: 8})
    assert led.resolve("a", accepted=False) == 0
    assert led.holdings("a") == [(1, 3)]           # rejected windows are trained again
    led.check()


def test_release_hands_partial_chunk_to_next_cluster_first():
    led = ChunkLedger(num_chunks=3, windows_per_chunk=10)
    led.lease("a", 1)
    led.report("a", {0: 4})
    led.resolve("a", True)
    led.report("a", {0: 9})                        # in flight when "a" crashes
    assert led.release("a") == [0]
    assert led.lease("b", 1) == [(0, 4)]           # resumes after the accepted windows
    led.report("b", {0: 10})
    assert led.resolve("b", True) == 6
    assert led.resolve("a", True) == 0             # the crashed cluster's report is gone
    led.check()


def test_epoch_rolls_over_when_every_chunk_is_finished():
    led = ChunkLedger(num_chunks=2, windows_per_chunk=5)
    led.lease("a", 2)
    led.report("a", {0: 5, 1: 5})
    led.resolve("a", True)
    assert led.free_chunks() == []
    assert led.lease("a", 1) == [(0, 0)] and led.epoch == 1
    led.check()


def test_bad_reports_are_refused_and_change_nothing():
    led = ChunkLedger(num_chunks=3, windows_per_chunk=10)
    led.lease("a", 1)
    before = led.to_dict()
    with pytest.raises(LedgerError, match="held by None"):
        led.report("a", {1: 2})
    with pytest.raises(LedgerError, match="position 11"):
        led.report("a", {0: 11})
    with pytest.raises(LedgerError, match="'chunk' = 7"):
        led.report("a", {7: 1})
    with pytest.raises(LedgerError, match="n=0"):
        led.lease("a", 0)
    assert led.to_dict() == before


def test_round_trip_and_malformed_state():
    led = ChunkLedger(num_chunks=3, windows_per_chunk=4)
    led.lease("a", 2)
    led.report("a", {0: 2})
    again = ChunkLedger.from_dict(led.to_dict())
    assert again.to_dict() == led.to_dict()
    bad = led.to_dict()
    bad["chunks"][0][1] = 99
    with pytest.raises(LedgerError):
        ChunkLedger.from_dict(bad)


ops = st.lists(st.tuples(st.sampled_from(["lease", "train", "accept", "reject", "release"]),
                         st.sampled_from(["a", "b", "c"]), st.integers(1, 10)), max_size=80)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_histories_never_lose_or_double_count(history):
    """A shadow copy of which windows were accepted, per epoch, must match the ledger."""
    w = 6
    led = ChunkLedger(num_chunks=4, windows_per_chunk=w)
    accepted = set()                               # (epoch, chunk, window)
    pos = {}                                       # cluster -> {chunk: local position}
    for op, cl, k in history:
        if op == "lease":
            for chunk, start in led.lease(cl, 1 + k % 2):
                pos.setdefault(cl, {})[chunk] = start
        elif op == "train" and pos.get(cl):
            prog = {c: min(w, p + k) for c, p in pos[cl].items()}
            led.report(cl, prog)
            pos[cl] = prog
        elif op in ("accept", "reject") and cl in led.pending:
            epoch, prog = led.epoch, dict(led.pending[cl])
            starts = dict(led.holdings(cl))
            gained = led.resolve(cl, op == "accept")
            if op == "accept":
                new = {(epoch, c, i) for c, u in prog.items() for i in range(starts[c], u)}
                assert not new & accepted
                accepted |= new
                assert gained == len(new)
            pos[cl] = dict(led.holdings(cl))
        elif op == "release":
            led.release(cl)
            pos.pop(cl, None)
        led.check()
    assert led.accepted_windows == len(accepted)


def test_rollback_unaccepts_lost_versions_and_frees_their_chunks():
    led = ChunkLedger(num_chunks=3, windows_per_chunk=10)
    led.lease("a", 1)
    led.lease("b", 1)
    led.report("a", {0: 4})
    led.resolve("a", True, version=1)
    led.report("b", {1: 6})
    led.resolve("b", True, version=2)
    led.report("a", {0: 9})
    led.resolve("a", True, version=3)
    assert led.rollback(1) == 11                   # versions 2 and 3 are lost
    assert led.accepted_windows == 4
    assert led.free_chunks() == [0, 1, 2]          # chunks 0 and 1 go back to the pool
    assert led.lease("c", 2) == [(0, 4), (1, 0)]   # 0 resumes after version 1's windows
    led.check()
