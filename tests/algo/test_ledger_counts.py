"""The ledger's chunk counters (issue 15: ``dips_ledger_chunks_{leased,accepted,returned}``):
what each transition counts, and that the counts survive the leader's checkpoint (counter
semantics across restarts); a malformed saved count is refused by name."""

from __future__ import annotations

import pytest

from dips.algo.ledger import ChunkLedger, LedgerError


def test_leases_acceptances_releases_and_rollbacks_are_counted_and_checkpointed():
    led = ChunkLedger(num_chunks=4, windows_per_chunk=2)
    assert led.counts == {"leased": 0, "accepted": 0, "returned": 0}
    led.lease("a", 2)                      # chunks 0, 1
    led.report("a", {0: 2, 1: 1})
    led.resolve("a", True, version=1)      # chunk 0 finished
    led.lease("b", 1)                      # chunk 2
    led.report("b", {2: 2})
    led.resolve("b", True, version=2)      # chunk 2 finished
    assert led.counts == {"leased": 3, "accepted": 2, "returned": 0}
    assert led.release("a") == [1]         # a leaves: chunk 1 back to the pool
    assert led.rollback(1) == 2            # version 2 lost: chunk 2 back
    assert led.counts == {"leased": 3, "accepted": 2, "returned": 2}
    again = ChunkLedger.from_dict(led.to_dict())  # the leader restarted
    assert again.counts == led.counts
    again.lease("c", 1)
    assert again.counts["leased"] == 4
    old = {k: v for k, v in led.to_dict().items() if k != "counts"}  # an older leader.json
    assert ChunkLedger.from_dict(old).counts == {"leased": 0, "accepted": 0, "returned": 0}
    with pytest.raises(LedgerError, match="field 'counts'"):
        ChunkLedger.from_dict({**led.to_dict(), "counts": {"leased": -1}})
