"""The data-chunk ledger kept by the leader (§12, §16, §18 of the seed: with a dynamic set of
clusters, data chunks must be coordinated globally; pre-cut many more chunks than clusters).

Unit of account: a *window* (one training sequence of T+1 tokens). Chunk c holds
``windows_per_chunk`` windows, visited in a fixed order; a cluster holding chunk c trains
its windows in that order from the chunk's *accepted* position onward.

Semantics (the rule that makes "never lost, never counted twice" hold):

* A window counts as trained exactly when the push that trained it is **accepted**.
* ``lease`` hands free chunks (those not held and not finished) to a cluster, each with the
  position to start from (its accepted position; a chunk left half-done by a crashed or
  departed cluster is resumed where its last accepted push ended).
* ``report`` records, for a push, how far the cluster got in each chunk it holds.
* ``resolve(accepted=True)`` advances each reported chunk's accepted position; a chunk
  whose windows are all accepted is finished. ``resolve(accepted=False)`` (rejected, failed
  or lost push) discards the report: the cluster must restart those chunks at their accepted
  positions (see :meth:`ChunkLedger.holdings`), so the rejected windows are trained again.
* ``release`` (graceful leave, heartbeat timeout, crash before rejoin) returns a cluster's
  chunks to the pool at their accepted positions and discards any pending report.
* When every chunk is finished, an epoch ends and all chunks become free again at 0.
* Work stealing at the pool's end (issue 13; review 14, F3: a member leasing chunks and never
  pushing kept every epoch from ending, since a new epoch needs every chunk finished): when
  ``lease`` finds too few free chunks, it reassigns chunks of another holder whose accepted
  position has not advanced for longer than ``idle_s`` seconds (never a chunk in that
  holder's unresolved report); the idle holder's later report on it is refused as not held,
  the holdings the leader returns (a lease, a verdict) no longer list it. Progress is timed
  with the ``now`` passed to :meth:`lease` and :meth:`observe`: an accepted advance counts
  as made at the next such call, a holder is first seen at the ``now`` of its first lease.
  The times are not checkpointed: after a restart every holder starts a fresh bound.
* ``rollback(version)``: when followers are reconciled to an older version (§12; a follower
  lost an outer step it had committed), the windows accepted by the lost versions are
  un-accepted again and their chunks returned to the pool, so that data is trained again
  (a report still pending on such a chunk no longer counts). The ledger keeps the window
  ranges of the last ``history`` versions for this, and the version after which each epoch
  began (``epoch_starts``): a rollback past the end of an epoch undoes the new epoch too,
  so the lost windows are trained again in their own epoch (issue 16: they had stayed
  accepted, the chunks of the new epoch untouched).

Accounting identity, checked by :meth:`check`: for every chunk, 0 <= accepted <=
windows_per_chunk, and a chunk is held by at most one cluster. The accepted window count
summed over epochs equals the windows of accepted pushes: nothing lost, nothing twice.
Pure: no clocks, threads or I/O.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from dips.algo.ledger_state import LedgerError, LedgerState, _Chunk

__all__ = ["IDLE_INTERVALS", "ChunkLedger", "LedgerError"]


#: A holder counts as idle only after this many of its own intervals between advances.
IDLE_INTERVALS = 3


@dataclass
class ChunkLedger(LedgerState):
    """Which chunks each cluster holds, has trained, and has had accepted.

    Args:
        num_chunks: chunks of the training stream (>= 1).
        windows_per_chunk: windows (sequences of T+1 tokens) in each chunk (>= 1).

    Raises:
        LedgerError: non-positive sizes.
    """

    num_chunks: int
    windows_per_chunk: int
    epoch: int = 0
    accepted_windows: int = 0
    chunks: list[_Chunk] = field(default_factory=list)
    pending: dict[str, dict[int, int]] = field(default_factory=dict)
    history: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    keep_history: int = 64
    #: epoch -> the newest version recorded when it began (-1: none); read by :meth:`rollback`.
    epoch_starts: dict[int, int] = field(default_factory=dict)
    #: holder -> when its accepted position last advanced (seconds, the caller's clock;
    #: None: advanced since the last ``now`` seen). Not checkpointed.
    progressed_at: dict[str, float | None] = field(default_factory=dict, repr=False, compare=False)
    #: holder -> seconds between its last two timed advances (its push interval, as seen).
    interval: dict[str, float] = field(default_factory=dict, repr=False, compare=False)
    _previous: dict[str, float] = field(default_factory=dict, repr=False, compare=False)
    #: Chunks ``leased`` (handed to a cluster, from an idle holder too), ``accepted`` (finished),
    #: ``returned`` to the pool (released, or rolled back), over the whole run (checkpointed).
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("leased", "accepted", "returned"), 0), repr=False, compare=False)
    #: Derived indexes (every change of a chunk goes through :meth:`_set`), so that a lease,
    #: a member's holdings, the holders and :meth:`observe` cost O(what changed), not
    #: O(chunks) or O(holders): holder -> chunks held; the free chunks, partially accepted and
    #: fresh (with a min-heap of the fresh, stale entries skipped when met); the members whose
    #: progress time :meth:`observe` must look at (new, advanced, or holding nothing now).
    _held: dict[str, set[int]] = field(default_factory=dict, repr=False, compare=False)
    _free_partial: set[int] = field(default_factory=set, repr=False, compare=False)
    _free_fresh: set[int] = field(default_factory=set, repr=False, compare=False)
    _fresh_heap: list[int] = field(default_factory=list, repr=False, compare=False)
    _unstamped: set[str] = field(default_factory=set, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_chunks < 1 or self.windows_per_chunk < 1:
            raise LedgerError(f"num_chunks = {self.num_chunks}, windows_per_chunk = "
                              f"{self.windows_per_chunk}: both must be >= 1")
        if not self.chunks:
            self.chunks = [_Chunk() for _ in range(self.num_chunks)]
        self._held, self._free_partial, self._free_fresh = self._index()
        self._fresh_heap = sorted(self._free_fresh)
        self._unstamped = set(self._held) | set(self.progressed_at)

    def _index(self) -> tuple[dict[str, set[int]], set[int], set[int]]:
        """The indexes built from ``chunks`` (see the fields)."""
        held: dict[str, set[int]] = {}
        partial, fresh = set(), set()
        for i, c in enumerate(self.chunks):
            if c.holder is not None:
                held.setdefault(c.holder, set()).add(i)
            elif not c.finished:
                (partial if c.accepted else fresh).add(i)
        return held, partial, fresh

    def _set(self, i: int, holder: str | None, accepted: int | None = None,
             finished: bool | None = None) -> None:
        """Chunk ``i`` is now held by ``holder`` (None: by nobody), at ``accepted`` and
        ``finished`` when given; the indexes follow."""
        c, held = self.chunks[i], self._held
        if c.holder is not None:
            held[c.holder].discard(i)
            if not held[c.holder]:
                del held[c.holder]
                self._unstamped.add(c.holder)
        self._free_partial.discard(i)
        self._free_fresh.discard(i)
        c.holder = holder
        c.accepted = c.accepted if accepted is None else accepted
        c.finished = c.finished if finished is None else finished
        if holder is not None:
            if holder not in held:
                held[holder] = set()
                self._unstamped.add(holder)
            held[holder].add(i)
        elif not c.finished and c.accepted:
            self._free_partial.add(i)
        elif not c.finished:
            self._free_fresh.add(i)
            heapq.heappush(self._fresh_heap, i)

    def _lowest_fresh(self, n: int) -> list[int]:
        """The ``n`` lowest fresh chunks (or fewer), in order; popped (the caller leases them)."""
        heap, out = self._fresh_heap, []
        while heap and len(out) < n:
            i = heapq.heappop(heap)
            if i in self._free_fresh and (not out or out[-1] != i):
                out.append(i)
        return out

    # ----- queries ----------------------------------------------------------------------
    def holdings(self, cluster: str) -> list[tuple[int, int]]:
        """(chunk, accepted position) of every chunk ``cluster`` holds, in chunk order."""
        return [(i, self.chunks[i].accepted) for i in sorted(self._held.get(cluster, ()))]

    def holders(self) -> set[str]:
        """The clusters holding at least one chunk."""
        return set(self._held)

    def free_chunks(self) -> list[int]:
        """Chunks neither held nor finished, in chunk order."""
        return sorted(self._free_partial | self._free_fresh)

    def idle_chunks(self, cluster: str, now: float, idle_s: float) -> list[int]:
        """Chunks ``cluster`` may take from another holder (module docstring: work stealing):
        held by a member whose accepted position has not advanced for more than ``idle_s``
        seconds at ``now``, nor for :data:`IDLE_INTERVALS` × its own interval between advances
        (a slow honest cluster pushing hourly keeps its chunks for 3 hours), and not in that
        holder's unresolved report; the longest idle holder's first, then partially accepted
        ones, then by id. Changes nothing but the progress times (:meth:`observe`)."""
        self.observe(now)
        out = []
        for holder, held in self._held.items():
            since = self.progressed_at.get(holder)
            bound = max(idle_s, IDLE_INTERVALS * self.interval.get(holder, 0.0))
            if holder == cluster or since is None or not now - since > bound:
                continue
            pending = self.pending.get(holder, {})
            out += [(since, self.chunks[i].accepted == 0, i) for i in held if i not in pending]
        return [i for _, _, i in sorted(out)]

    def observe(self, now: float) -> None:
        """Time the progress made since the last call: a holder whose accepted position
        advanced meanwhile, or first seen holding chunks, counts as having progressed at
        ``now`` (seconds); a member holding nothing is forgotten."""
        for h in sorted(self._unstamped):
            if h not in self._held:
                self.progressed_at.pop(h, None)
                self.interval.pop(h, None)
            elif self.progressed_at.get(h) is None:
                if h in self._previous:
                    self.interval[h] = now - self._previous.pop(h)
                self.progressed_at[h] = now
        self._unstamped.clear()

    # ----- transitions ------------------------------------------------------------------
    def lease(self, cluster: str, n: int, now: float | None = None,
              idle_s: float | None = None) -> list[tuple[int, int]]:
        """Give ``cluster`` up to ``n`` more free chunks; returns [(chunk, start position)].
        Partially accepted chunks go first (they were left by a departed cluster). If no chunk
        is free and every chunk is finished, a new epoch starts. With ``now`` (seconds, the
        caller's clock) and ``idle_s``, chunks still missing are taken from holders idle for
        more than ``idle_s`` seconds (:meth:`idle_chunks`); they start at their accepted
        positions. Raises LedgerError for n < 1 or an empty cluster id.
        """
        if not cluster or n < 1:
            raise LedgerError(f"lease(cluster={cluster!r}, n={n}): need an id and n >= 1")
        # every chunk finished = none held, none free (a finished chunk is never held)
        if not (self._held or self._free_partial or self._free_fresh):
            self._new_epoch()
        take = sorted(self._free_partial)[:n]
        take += self._lowest_fresh(n - len(take))
        if now is not None:
            self.observe(now)
            if idle_s is not None and len(take) < n:
                take += self.idle_chunks(cluster, now, idle_s)[:n - len(take)]
        for i in take:
            self._set(i, cluster)
        out = [(i, self.chunks[i].accepted) for i in take]
        self.counts["leased"] += len(out)
        if now is not None:
            self.observe(now)
        return out

    def windows_in(self, cluster: str, progress: dict[int, int]) -> int:
        """Windows that ``progress`` (chunk → window position reached) trained beyond the
        accepted positions: what a push with this report carries (§6: T_j = these windows ×
        tokens per window). Changes nothing.

        Raises LedgerError if a chunk is not held by ``cluster``, or a position is before the
        accepted one or past the chunk's end.
        """
        total = 0
        for chunk, upto in progress.items():
            if not 0 <= chunk < self.num_chunks:
                raise LedgerError(f"report field 'chunk' = {chunk} not in [0, {self.num_chunks})")
            c = self.chunks[chunk]
            if c.holder != cluster:
                raise LedgerError(f"report: chunk {chunk} is held by {c.holder!r}, not {cluster!r}")
            if not c.accepted <= upto <= self.windows_per_chunk:
                raise LedgerError(f"report: chunk {chunk} position {upto} not in "
                                  f"[{c.accepted}, {self.windows_per_chunk}]")
            total += upto - c.accepted
        return total

    def credit(self, cluster: str, progress: dict[int, int],
               max_windows: int | None) -> dict[int, int]:
        """The part of ``progress`` one push is credited with: at most ``max_windows`` windows
        beyond the accepted positions, taken in chunk order, the positions past them cut back
        (None: all). Bounds the data a member can mark trained per push, whatever positions it
        reports (issue 13: a member lying about its progress burns at most one push's worth of
        data per accepted push; an honest cluster rewinds to the credited positions from its
        verdict and trains the rest again). Changes nothing.

        Raises LedgerError as :meth:`windows_in`, or if ``max_windows`` < 0.
        """
        self.windows_in(cluster, progress)
        if max_windows is None:
            return dict(progress)
        if max_windows < 0:
            raise LedgerError(f"max_windows = {max_windows} must be >= 0")
        left, out = max_windows, {}
        for chunk in sorted(progress):
            accepted = self.chunks[chunk].accepted
            out[chunk] = accepted + min(progress[chunk] - accepted, left)
            left -= out[chunk] - accepted
        return out

    def report(self, cluster: str, progress: dict[int, int]) -> int:
        """Record that ``cluster``'s push trained chunk → window position ``progress``; returns
        the windows it carries (:meth:`windows_in`). Replaces an earlier unresolved report.

        Raises LedgerError as :meth:`windows_in` (nothing is recorded then).
        """
        windows = self.windows_in(cluster, progress)
        self.pending[cluster] = dict(progress)
        return windows

    def resolve(self, cluster: str, accepted: bool, version: int | None = None) -> int:
        """Settle ``cluster``'s pending report; returns the windows newly accepted (0 if none).
        ``version``: the outer step that accepted it (recorded so :meth:`rollback` can undo it)."""
        progress = self.pending.pop(cluster, {})
        if not accepted:
            return 0
        gained = 0
        ranges = self.history.setdefault(version, []) if version is not None else []
        for chunk, upto in progress.items():
            c = self.chunks[chunk]
            if c.holder != cluster:
                continue  # released meanwhile: the report no longer counts
            if upto > c.accepted and self.progressed_at.get(cluster) is not None:
                self._previous[cluster] = self.progressed_at[cluster]
                self.progressed_at[cluster] = None  # timed at the next observe
                self._unstamped.add(cluster)
            gained += upto - c.accepted
            ranges.append((chunk, c.accepted, upto))
            c.accepted = upto  # still held: no index changes
            if upto == self.windows_per_chunk:
                self._set(chunk, None, finished=True)
                self.counts["accepted"] += 1
        self.accepted_windows += gained
        for old in sorted(self.history)[:-self.keep_history]:
            del self.history[old]
        return gained

    def rollback(self, version: int) -> int:
        """Un-accept the windows of every recorded version above ``version``, newest first;
        their chunks return to the pool, a report still pending on one of them no longer
        counts. An epoch that began after a version undone is undone before it (every chunk
        finished again, as when the epoch began), so that version's windows are trained
        again in their own epoch. Returns the windows un-accepted."""
        lost, returned = 0, set()
        for v in sorted((v for v in self.history if v > version), reverse=True):
            while self.epoch_starts.get(self.epoch, -1) >= v:
                lost += self._undo_epoch(returned)
            for chunk, start, upto in reversed(self.history.pop(v)):
                if self.chunks[chunk].accepted != upto:
                    continue  # reset by an epoch not recorded (a state of before issue 16)
                self._take_back(chunk, start, False)
                lost += upto - start
                returned.add(chunk)
        while self.epoch_starts.get(self.epoch, -1) > version:
            lost += self._undo_epoch(returned)
        self.accepted_windows -= lost
        self.counts["returned"] += len(returned)
        return lost

    def _take_back(self, i: int, accepted: int, finished: bool) -> None:
        """Chunk ``i`` back to the pool at ``accepted``; its holder's pending report loses it."""
        holder = self.chunks[i].holder
        if holder is not None and i in self.pending.get(holder, {}):
            del self.pending[holder][i]
        self._set(i, None, accepted, finished)

    def _undo_epoch(self, returned: set[int]) -> int:
        """The current epoch had not begun: every chunk finished (the ones held go in
        ``returned``); returns the windows it had accepted (those of versions already undone
        are 0 again: none, unless accepted without a version)."""
        stray = sum(c.accepted for c in self.chunks)
        del self.epoch_starts[self.epoch]
        self.epoch -= 1
        for i, c in enumerate(self.chunks):
            if c.holder is not None:
                returned.add(i)
            self._take_back(i, self.windows_per_chunk, True)
        return stray

    def release(self, cluster: str) -> list[int]:
        """Return every chunk ``cluster`` holds to the pool; returns their ids."""
        self.pending.pop(cluster, None)
        out = sorted(self._held.get(cluster, ()))
        for i in out:
            self._set(i, None)
        self.counts["returned"] += len(out)
        return out

    def _new_epoch(self) -> None:
        self.epoch += 1
        self.epoch_starts[self.epoch] = max(self.history, default=-1)
        for old in sorted(self.epoch_starts)[:-self.keep_history]:
            del self.epoch_starts[old]
        for i in range(self.num_chunks):
            self._set(i, None, 0, False)
