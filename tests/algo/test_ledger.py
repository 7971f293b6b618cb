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


def test_a_push_is_credited_with_at_most_max_windows_in_chunk_order():
    led = ChunkLedger(num_chunks=4, windows_per_chunk=10)
    led.lease("a", 3)
    led.report("a", {0: 4})
    led.resolve("a", True)                         # chunk 0 accepted up to 4
    claim = {2: 10, 0: 10, 1: 10}                  # 6 + 10 + 10 windows claimed
    assert led.credit("a", claim, 9) == {0: 10, 1: 3, 2: 0}
    assert led.credit("a", claim, None) == claim
    assert led.credit("a", claim, 100) == claim
    assert led.credit("a", claim, 0) == {0: 4, 1: 0, 2: 0}
    assert led.windows_in("a", led.credit("a", claim, 9)) == 9
    with pytest.raises(LedgerError, match="held by"):
        led.credit("b", claim, 9)                  # validated before it is cut
    with pytest.raises(LedgerError, match="max_windows"):
        led.credit("a", claim, -1)
    assert led.holdings("a") == [(0, 4), (1, 0), (2, 0)]  # changes nothing


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


def test_a_chunk_changed_behind_the_ledgers_back_fails_the_check():
    """The holder and free-chunk indexes are derived from the chunks; check() compares them."""
    led = ChunkLedger(num_chunks=3, windows_per_chunk=10)
    led.lease("a", 1)
    led.check()
    led.chunks[2].holder = "b"  # not through the ledger: the indexes do not know
    with pytest.raises(LedgerError, match="indexes disagree"):
        led.check()
    ChunkLedger.from_dict(led.to_dict()).check()  # a loaded state builds its indexes afresh


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


def test_a_hoarders_chunks_go_to_a_member_that_asks_once_the_pool_is_empty():
    """Review 14, F3: a member leased its cap (9 of 24 chunks) and never pushed; the
    others finished the rest, and since an epoch needs every chunk finished, the run stopped
    until the hoarder was removed. Once no chunk is free, a member that asks now gets the
    chunks of a holder whose accepted position stood still for more than ``idle_s``."""
    led = ChunkLedger(num_chunks=24, windows_per_chunk=2)
    hoard = [c for c, _ in led.lease("h", 9, now=0.0, idle_s=30.0)]
    for t, cl in enumerate("ab" * 8):
        for chunk, _ in led.lease(cl, 1, now=float(t), idle_s=30.0):
            led.report(cl, {chunk: 2})
            led.resolve(cl, True)
    assert led.free_chunks() == [] and led.summary()["finished"] == 15
    assert led.lease("a", 2, now=30.0, idle_s=30.0) == []   # not idle for more than 30 s yet
    assert led.lease("a", 2, now=30.5, idle_s=30.0) == [(hoard[0], 0), (hoard[1], 0)]
    with pytest.raises(LedgerError, match="held by 'a'"):
        led.report("h", {hoard[0]: 2})                      # the idle holder's report is refused
    assert [c for c, _ in led.holdings("h")] == hoard[2:]   # what its client re-syncs to
    for cl in "abab":                                       # the others take the rest
        led.lease(cl, 2, now=31.0, idle_s=30.0)
        led.report(cl, {chunk: 2 for chunk, _ in led.holdings(cl)})
        led.resolve(cl, True)
        led.check()
    assert led.holdings("h") == [] and led.summary()["finished"] == 24
    assert led.lease("a", 1, now=32.0, idle_s=30.0) == [(0, 0)] and led.epoch == 1
    assert led.accepted_windows == 24 * 2                   # nothing lost, nothing twice
    led.check()


def test_a_holder_that_progresses_or_has_a_push_in_flight_keeps_its_chunks():
    led = ChunkLedger(num_chunks=2, windows_per_chunk=10)
    led.lease("s", 2, now=0.0, idle_s=30.0)                 # slow, honest: chunks 0 and 1
    for t in (20.0, 40.0, 60.0):                            # an accepted advance every 20 s
        led.report("s", {0: int(t / 10)})
        led.resolve("s", True)
        led.observe(t)                                      # the leader's next heartbeat
        assert led.lease("a", 1, now=t + 25.0, idle_s=30.0) == []
    assert led.holdings("s") == [(0, 6), (1, 0)]            # chunk 1 kept while 0 advances
    # Idle 35 s > idle_s, but under 3 of its own 20 s intervals: a slow pusher keeps its chunks.
    assert led.lease("a", 2, now=95.0, idle_s=30.0) == []
    led.report("s", {0: 8})                                 # a push in flight on chunk 0
    assert led.lease("a", 2, now=121.0, idle_s=30.0) == [(1, 0)]
    led.resolve("s", True)                                  # its verdict still counts
    assert led.holdings("s") == [(0, 8)]
    assert led.lease("a", 1, now=1000.0) == []              # no bound, no reassignment
    assert led.lease("b", 1, now=1000.0, idle_s=30.0) == [(1, 0)]  # "a" was seen at 95
    led.check()


def test_a_lease_does_not_restart_the_holders_idle_time():
    led = ChunkLedger(num_chunks=3, windows_per_chunk=10)
    led.lease("h", 1, now=0.0, idle_s=30.0)
    led.lease("h", 1, now=20.0, idle_s=30.0)                # asking again is no progress
    led.lease("a", 1, now=20.0, idle_s=30.0)
    assert led.lease("b", 2, now=31.0, idle_s=30.0) == [(0, 0), (1, 0)]
    assert led.lease("h", 1, now=31.0, idle_s=30.0) == []   # "a" and "b" hold theirs since 20, 31
    led.check()


def test_idle_times_are_not_checkpointed_and_an_older_state_loads():
    old = {"num_chunks": 2, "windows_per_chunk": 4, "epoch": 0, "accepted_windows": 1,
           "chunks": [["h", 1, False], [None, 0, False]], "pending": {}}  # no "history" either
    led = ChunkLedger.from_dict(old)
    assert led.lease("a", 1, now=500.0, idle_s=30.0) == [(1, 0)]
    assert led.lease("a", 1, now=530.0, idle_s=30.0) == []   # "h" is first seen at 500
    assert led.lease("a", 1, now=531.0, idle_s=30.0) == [(0, 1)]
    assert set(led.to_dict()) == {"num_chunks", "windows_per_chunk", "epoch",
                                  "accepted_windows", "chunks", "pending", "history", "epoch_starts",
                                  "counts"}
    again = ChunkLedger.from_dict(led.to_dict())
    assert again.to_dict() == led.to_dict() and again.progressed_at == {}
    again.check()


steal_ops = st.lists(st.tuples(st.sampled_from(["lease", "train", "accept", "reject", "release",
                                                "wait"]),
                               st.sampled_from(["a", "b", "c"]), st.integers(1, 10)),
                     max_size=80)


@settings(max_examples=150, deadline=None)
@given(steal_ops)
def test_random_histories_with_reassignment_never_lose_or_double_count(history):
    """A shadow copy of which windows were accepted, per epoch, must match the ledger, with
    time passing and idle holders' chunks reassigned: a member whose report names a chunk it
    lost is refused and re-syncs its holdings, as its client does."""
    w, now = 6, 0.0
    led = ChunkLedger(num_chunks=4, windows_per_chunk=w)
    accepted = set()                               # (epoch, chunk, window)
    pos = {}                                       # cluster -> {chunk: local position}
    for op, cl, k in history:
        if op == "wait":
            now += 4.0 * k
        elif op == "lease":
            for chunk, start in led.lease(cl, 1 + k % 2, now=now, idle_s=15.0):
                pos.setdefault(cl, {})[chunk] = start
        elif op == "train" and pos.get(cl):
            prog = {c: min(w, p + k) for c, p in pos[cl].items()}
            try:
                led.report(cl, prog)
                pos[cl] = prog
            except LedgerError:
                pos[cl] = dict(led.holdings(cl))
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
        led.check()  # also: the holder and free-chunk indexes agree with the chunks
        assert led.holdings(cl) == [(i, c.accepted) for i, c in enumerate(led.chunks)
                                    if c.holder == cl]
        assert led.free_chunks() == [i for i, c in enumerate(led.chunks)
                                     if c.holder is None and not c.finished]
    assert led.accepted_windows == len(accepted)
