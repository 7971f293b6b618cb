"""The data-chunk ledger's invariants and persistence (:class:`dips.algo.ledger.ChunkLedger`;
§12 of the seed: the leader's checkpoint holds it): the accounting check, the summary for
logs, and the JSON-able state of ``leader.json``, row by row (:func:`chunk_row`,
:func:`pending_row`, :func:`history_row`), so that a copy kept up to date by changes
(:class:`dips.sim.ledger_journal.JournaledLedger`) writes the same rows. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LedgerError", "LedgerState", "chunk_row", "history_row", "pending_row"]


class LedgerError(ValueError):
    """A report or request that contradicts the ledger (names the field and value)."""


@dataclass
class _Chunk:
    holder: str | None = None
    accepted: int = 0
    finished: bool = False


def chunk_row(c: _Chunk) -> list[Any]:
    """A chunk as ``to_dict`` writes it: [holder or None, accepted position, finished]."""
    return [c.holder, c.accepted, c.finished]


def pending_row(progress: dict[int, int]) -> dict[str, int]:
    """A pending report as ``to_dict`` writes it: chunk (as a string) -> position."""
    return {str(c): u for c, u in progress.items()}


def history_row(ranges: list[tuple[int, int, int]]) -> list[list[int]]:
    """A version's accepted ranges as ``to_dict`` writes them: [chunk, start, end] each."""
    return [list(r) for r in ranges]


class LedgerState:
    """The check and persistence of :class:`~dips.algo.ledger.ChunkLedger` (a mixin: the
    fields are the ledger's)."""

    num_chunks: int
    windows_per_chunk: int
    epoch: int
    accepted_windows: int
    chunks: list[_Chunk]
    pending: dict[str, dict[int, int]]
    history: dict[int, list[tuple[int, int, int]]]
    epoch_starts: dict[int, int]
    counts: dict[str, int]
    _held: dict[str, set[int]]
    _free_partial: set[int]
    _free_fresh: set[int]
    _fresh_heap: list[int]

    def check(self) -> None:
        """Raise LedgerError if an invariant is broken (see :mod:`dips.algo.ledger`)."""
        total = 0
        for i, c in enumerate(self.chunks):
            if not 0 <= c.accepted <= self.windows_per_chunk:
                raise LedgerError(f"chunk {i}: accepted {c.accepted} out of range")
            if c.finished != (c.accepted == self.windows_per_chunk):
                raise LedgerError(f"chunk {i}: finished={c.finished} but accepted={c.accepted}")
            if c.finished and c.holder is not None:
                raise LedgerError(f"chunk {i}: finished but held by {c.holder!r}")
            total += c.accepted
        expected = self.accepted_windows - self.epoch * self.num_chunks * self.windows_per_chunk
        if total != expected:
            raise LedgerError(f"accepted windows {total} in chunks != {expected} accounted")
        if ((self._held, self._free_partial, self._free_fresh) != self._index()
                or not self._free_fresh <= set(self._fresh_heap)):
            raise LedgerError("the ledger's holder and free-chunk indexes disagree with its chunks")

    def summary(self) -> dict[str, Any]:
        """Counts for logs: epoch, accepted windows (all epochs), finished/held/free chunks."""
        held, free = sum(map(len, self._held.values())), len(self._free_partial | self._free_fresh)
        return {"epoch": self.epoch, "accepted_windows": self.accepted_windows,
                "finished": self.num_chunks - held - free, "held": held, "free": free}

    def to_dict(self) -> dict[str, Any]:
        """JSON-able state (for the leader's checkpoint)."""
        return {"num_chunks": self.num_chunks, "windows_per_chunk": self.windows_per_chunk,
                "epoch": self.epoch, "accepted_windows": self.accepted_windows,
                "chunks": [chunk_row(c) for c in self.chunks],
                "pending": {k: pending_row(v) for k, v in self.pending.items()},
                "history": {str(v): history_row(rs) for v, rs in self.history.items()},
                "epoch_starts": {str(e): v for e, v in self.epoch_starts.items()},
                "counts": dict(self.counts)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Any:
        """Inverse of :meth:`to_dict` (a state without ``epoch_starts``, written before issue
        16's fix, loads with none: a rollback then does not reach back past an epoch's end);
        raises LedgerError if the state is inconsistent."""
        try:
            led = cls(int(d["num_chunks"]), int(d["windows_per_chunk"]), int(d["epoch"]),
                      int(d["accepted_windows"]),
                      [_Chunk(h, int(a), bool(f)) for h, a, f in d["chunks"]],
                      {k: {int(c): int(u) for c, u in v.items()} for k, v in d["pending"].items()},
                      {int(v): [tuple(int(x) for x in r) for r in rs]
                       for v, rs in d.get("history", {}).items()})
            led.epoch_starts = {int(e): int(v) for e, v in d.get("epoch_starts", {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise LedgerError(f"ledger state is malformed: {exc}") from None
        counts = d.get("counts") or {}
        if not isinstance(counts, dict) or not all(
                isinstance(counts.get(k, 0), int) and counts.get(k, 0) >= 0 for k in led.counts):
            raise LedgerError(f"ledger state field 'counts' = {str(counts)[:60]}: not counts")
        led.counts.update({k: int(counts.get(k, 0)) for k in led.counts})
        if len(led.chunks) != led.num_chunks:
            raise LedgerError(f"ledger state has {len(led.chunks)} chunks, expected {led.num_chunks}")
        led.check()
        return led
