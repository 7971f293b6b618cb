"""The simulated leader's checkpoint of its data-chunk ledger in O(changes) (issue 16).

The simulator keeps a copy of ``leader.json`` wherever the leader writes it (several times a
round) when a leader fault is scheduled or drawn (:mod:`dips.sim.faults`). The ledger's
:meth:`~dips.algo.ledger_state.LedgerState.to_dict` costs O(chunks) — 0.4M chunks in a
30-day 1,024-cluster projection. :class:`JournaledLedger` is the same ledger (every decision
is :class:`~dips.algo.ledger.ChunkLedger`'s) noting which chunks, pending reports and
history versions changed; :meth:`JournaledLedger.checkpoint` brings one kept copy up to date
from those changes and returns a dict equal to ``to_dict()`` (the same rows, written by
:mod:`dips.algo.ledger_state`'s row functions), O(changed chunks + members + kept versions).
"""

from __future__ import annotations

from typing import Any

from dips.algo.ledger import ChunkLedger
from dips.algo.ledger_state import chunk_row, history_row, pending_row

__all__ = ["JournaledLedger"]


class JournaledLedger(ChunkLedger):
    """A :class:`ChunkLedger` whose :meth:`checkpoint` costs O(changes) (module docstring)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._rows: list[list[Any]] | None = None  # the chunk rows of the last checkpoint
        self._pending_rows: dict[str, dict[str, int]] = {}
        self._history_rows: dict[int, list[list[int]]] = {}
        self._dirty: set[int] = set()
        self._dirty_pending: set[str] = set()
        self._dirty_versions: set[int] = set()

    # every change of a chunk's holder, position or state goes through _set or resolve
    def _set(self, i: int, holder: str | None, accepted: int | None = None,
             finished: bool | None = None) -> None:
        self._dirty.add(i)
        if self.chunks[i].holder is not None:
            self._dirty_pending.add(self.chunks[i].holder)  # rollback may edit its report
        super()._set(i, holder, accepted, finished)

    def report(self, cluster: str, progress: dict[int, int]) -> int:
        self._dirty_pending.add(cluster)
        return super().report(cluster, progress)

    def resolve(self, cluster: str, accepted: bool, version: int | None = None) -> int:
        self._dirty.update(self.pending.get(cluster, ()))  # positions set in place
        self._dirty_pending.add(cluster)
        if version is not None:
            self._dirty_versions.add(version)
        return super().resolve(cluster, accepted, version)

    def release(self, cluster: str) -> list[int]:
        self._dirty_pending.add(cluster)
        return super().release(cluster)

    def rollback(self, version: int) -> int:
        self._dirty_versions.update(v for v in self.history if v > version)
        return super().rollback(version)

    def _pending_row(self, cluster: str) -> dict[str, int]:
        row = self._pending_rows.get(cluster)
        if row is None:  # (pending set from outside: the restored leader's clear)
            row = self._pending_rows[cluster] = pending_row(self.pending[cluster])
        return row

    def checkpoint(self) -> dict[str, Any]:
        """A dict equal to :meth:`to_dict` now. Its ``chunks`` list is the kept copy, updated
        in place by the next call: only the newest checkpoint is valid (as ``leader.json``)."""
        if self._rows is None or len(self._rows) != len(self.chunks):
            self._rows = [chunk_row(c) for c in self.chunks]
        else:
            for i in self._dirty:
                self._rows[i] = chunk_row(self.chunks[i])
        self._dirty.clear()
        for k in self._dirty_pending:
            if k in self.pending:
                self._pending_rows[k] = pending_row(self.pending[k])
            else:
                self._pending_rows.pop(k, None)
        self._dirty_pending.clear()
        for v in self._dirty_versions:
            self._history_rows.pop(v, None)
        self._dirty_versions.clear()
        for v, rs in self.history.items():
            if v not in self._history_rows:
                self._history_rows[v] = history_row(rs)
        for v in [v for v in self._history_rows if v not in self.history]:
            del self._history_rows[v]
        return {"num_chunks": self.num_chunks, "windows_per_chunk": self.windows_per_chunk,
                "epoch": self.epoch, "accepted_windows": self.accepted_windows,
                "chunks": self._rows,
                "pending": {k: self._pending_row(k) for k in self.pending},
                "history": {str(v): self._history_rows[v] for v in self.history},
                "epoch_starts": {str(e): v for e, v in self.epoch_starts.items()},
                "counts": dict(self.counts)}
