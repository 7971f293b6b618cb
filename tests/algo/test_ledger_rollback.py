"""``ChunkLedger.rollback`` and the leader's restart from a checkpoint, across data epochs
(issue 16): random sequences of lease / report / outer step (accept or reject) / release /
rollback / checkpoint / restore, the epoch rolling over when every chunk is finished, checked
after every operation against a simple reference model of the data accounting — for every
chunk of the current epoch its accepted position, and the windows accepted over all epochs:
a rolled-back step's windows are un-accepted and trained again in the epoch they belong to
(none lost), and no window is counted twice (DESIGN.md invariant; §12 of the seed)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dips.algo.ledger import ChunkLedger

CLUSTERS = ("a", "b", "c")


class Reference:
    """The data accounting of the ledger, kept independently: the epoch, each chunk's accepted
    position, the windows accepted over all epochs, and their state after each version."""

    def __init__(self, n: int, w: int) -> None:
        self.n, self.w = n, w
        self.epoch, self.pos, self.total = 0, [0] * n, 0
        self.snaps = {0: self.state()}
        self.pending: dict[str, dict[int, tuple[int, int, int]]] = {}

    def state(self) -> tuple[int, tuple[int, ...], int]:
        return self.epoch, tuple(self.pos), self.total

    def normal(self, epoch: int, pos: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        """An epoch with every chunk finished is the next epoch at 0 (the ledger rolls over
        at the next lease)."""
        return (epoch + 1, (0,) * self.n) if all(p == self.w for p in pos) else (epoch, pos)

    def settle(self) -> None:
        self.epoch, pos = self.normal(self.epoch, tuple(self.pos))
        self.pos = list(pos)

    def restore(self, state: tuple[int, tuple[int, ...], int]) -> None:
        self.epoch, pos, self.total = state
        self.pos = list(pos)
        self.settle()


def _same(led: ChunkLedger, ref: Reference) -> None:
    led.check()
    mine = ref.normal(led.epoch, tuple(c.accepted for c in led.chunks))
    assert mine == (ref.epoch, tuple(ref.pos)), "chunk positions differ from the reference"
    assert led.accepted_windows == ref.total, "accepted windows differ from the reference"


OPS = st.lists(st.tuples(
    st.sampled_from(["lease"] * 3 + ["report"] * 3 + ["step"] * 3 +
                    ["release", "rollback", "rollback", "checkpoint", "restore"]),
    st.sampled_from(CLUSTERS), st.integers(0, 7), st.lists(st.integers(0, 6), max_size=4)),
    min_size=20, max_size=80)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 3), w=st.integers(1, 3), ops=OPS)
def test_rollback_and_restore_across_epochs_match_the_reference(n, w, ops):
    led, ref, version = ChunkLedger(n, w), Reference(n, w), 0
    saved = None
    for op, cid, k, picks in ops:
        if op == "lease":
            for chunk, start in led.lease(cid, 1 + k % 3):  # (a new epoch: ref at 0)
                assert start == ref.pos[chunk], "a chunk leased from another position"
            assert ref.normal(led.epoch, tuple(c.accepted for c in led.chunks))[0] == ref.epoch
        elif op == "report":
            held = led.holdings(cid)
            if not held:
                continue
            # to the chunk's end for k >= 3 (epochs end often), else some way into it
            progress = {c: w if k >= 3 else a + (picks[i] if i < len(picks) else k) % (w - a + 1)
                        for i, (c, a) in enumerate(held)}
            led.report(cid, progress)
            ref.pending[cid] = {c: (ref.pos[c], u, ref.epoch) for c, u in progress.items()}
        elif op == "step":  # an outer step: every pending push decided, bit i of k accepts
            version += 1
            for i, c in enumerate(sorted(led.pending)):
                accept = bool(k >> i & 1)
                holder = {ch: led.chunks[ch].holder for ch in led.pending[c]}
                gained = led.resolve(c, accept, version)
                expect = 0
                for ch, (base, upto, epoch) in ref.pending.pop(c, {}).items():
                    # counts only if nothing moved the chunk since the report
                    if accept and holder[ch] == c and epoch == ref.epoch \
                            and ref.pos[ch] == base:
                        expect += upto - base
                        ref.pos[ch] = upto
                ref.total += expect
                assert gained == expect, f"resolve({c!r}) credited {gained}, expected {expect}"
            ref.settle()
            ref.snaps[version] = ref.state()
        elif op == "release":
            led.release(cid)
            ref.pending.pop(cid, None)
        elif op == "rollback":  # followers reconciled k % 4 versions back
            target = max(0, version - k % 4)
            led.rollback(target)
            for c, entries in ref.pending.items():  # a chunk taken from its holder: its
                for ch in [ch for ch in entries if led.chunks[ch].holder != c]:
                    del entries[ch]  # report no longer counts
            ref.restore(ref.snaps[target])
            ref.snaps = {v: s for v, s in ref.snaps.items() if v <= target}
            version = target
        elif op == "checkpoint":
            d = led.to_dict()
            assert ChunkLedger.from_dict(d).to_dict() == d
            saved = (d, ref.state(), version, dict(ref.snaps))
        elif op == "restore" and saved is not None:  # the leader restarts from leader.json
            d, state, version, snaps = saved
            led = ChunkLedger.from_dict(d)
            led.pending.clear()  # pushes in flight at the crash are lost
            ref.restore(state)
            ref.snaps = dict(snaps)
            ref.pending.clear()
        _same(led, ref)


def test_a_rollback_past_the_end_of_an_epoch_trains_its_windows_again():
    led = ChunkLedger(num_chunks=2, windows_per_chunk=4)
    led.lease("a", 2)
    led.report("a", {0: 4, 1: 2})
    led.resolve("a", True, version=1)
    led.report("a", {1: 4})
    led.resolve("a", True, version=2)  # every chunk finished: epoch 0 ends
    assert led.lease("b", 1) == [(0, 0)]  # epoch 1
    led.report("b", {0: 3})
    led.resolve("b", True, version=3)
    assert led.rollback(1) == 2 + 3  # version 2 (epoch 0) and 3 (epoch 1) undone
    assert (led.epoch, led.accepted_windows) == (0, 6)
    assert [(c.accepted, c.finished, c.holder) for c in led.chunks] == [
        (4, True, None), (2, False, None)]
    assert led.lease("c", 2) == [(1, 2)]  # the lost windows of chunk 1, then a new epoch
    led.check()


def test_a_report_on_a_chunk_taken_back_by_a_rollback_no_longer_counts():
    led = ChunkLedger(num_chunks=1, windows_per_chunk=10)
    led.lease("a", 1)
    led.report("a", {0: 5})
    led.resolve("a", True, version=1)
    led.report("a", {0: 8})  # in flight while the followers are reconciled to version 0
    assert led.rollback(0) == 5
    assert led.lease("a", 1) == [(0, 0)]  # handed out again, to the same cluster
    assert led.resolve("a", True, version=1) == 0  # its old report (5 → 8) is gone
    assert led.accepted_windows == 0
    led.check()
