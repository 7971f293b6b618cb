"""Batches from the data chunks the leader leased to this cluster (§12 of the seed).

The training stream is cut into chunks (:func:`dips.train.sampler.make_chunks`); chunk c is
read as ``windows_per_chunk`` non-overlapping windows of T+1 tokens, visited in a fixed
pseudo-random order that depends only on (run seed, c), so any cluster resuming a chunk at
window position p continues exactly where the previous holder's accepted data ended.
Positions follow the ledger (:mod:`dips.algo.ledger`): the leader's holdings after each
verdict are authoritative (:meth:`LeaseSampler.set_holdings`), a lease adds chunks without
rewinding local progress (:meth:`LeaseSampler.merge_holdings`).
"""

from __future__ import annotations

import numpy as np
import torch


class NoData(LookupError):
    """Fewer windows are left in the held chunks than one batch needs: lease more."""


class LeaseSampler:
    """Ledger-aware batch source.

    Args:
        tokens: the training stream, 1-D integer array.
        chunks: [(start, end)) token ranges of every chunk (the same list everywhere).
        seq_len: T, tokens per training sequence (a window holds T+1).
        batch_size: windows per inner step.
        seed: the run's seed (same in every cluster: window order is a property of the chunk).
        ahead: unfinished chunks to keep leased, so training can go on while the leader is
            briefly unreachable.

    Raises:
        ValueError: a chunk shorter than one window, or non-positive sizes.
    """

    def __init__(self, tokens: np.ndarray, chunks: list[tuple[int, int]], seq_len: int,
                 batch_size: int, seed: int, ahead: int = 2) -> None:
        if seq_len < 1 or batch_size < 1 or ahead < 1:
            raise ValueError(f"seq_len={seq_len}, batch_size={batch_size}, ahead={ahead} must be >= 1")
        self.windows_per_chunk = min((e - s) // (seq_len + 1) for s, e in chunks)
        if self.windows_per_chunk < 1:
            raise ValueError(f"chunks of {min(e - s for s, e in chunks)} tokens hold no window "
                             f"of {seq_len + 1} tokens")
        self.tokens = tokens
        self.chunks = chunks
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.ahead = ahead
        self._held: dict[int, int] = {}
        self._perms: dict[int, np.ndarray] = {}
        #: Train the windows left even if fewer than a batch (set when no chunk can be leased:
        #: the held chunks can only finish, and a new epoch begin, once those are trained).
        self.drain = False

    @property
    def tokens_per_batch(self) -> int:
        """Tokens trained on per inner step: batch_size × seq_len."""
        return self.batch_size * self.seq_len

    def set_holdings(self, holdings: list[tuple[int, int]]) -> None:
        """Replace the held chunks and positions with the leader's (authoritative)."""
        self._held = {self._check(c, p)[0]: p for c, p in holdings}

    def merge_holdings(self, holdings: list[tuple[int, int]]) -> None:
        """Adopt the leader's set of chunks, keeping local progress on those already held."""
        self._held = {self._check(c, p)[0]: max(p, self._held.get(c, p)) for c, p in holdings}

    def _check(self, chunk: int, pos: int) -> tuple[int, int]:
        if not 0 <= chunk < len(self.chunks) or not 0 <= pos <= self.windows_per_chunk:
            raise ValueError(f"holding (chunk={chunk}, position={pos}) out of range "
                             f"({len(self.chunks)} chunks of {self.windows_per_chunk} windows)")
        return chunk, pos

    def positions(self) -> dict[int, int]:
        """Held chunk → next window position (what a push reports)."""
        return dict(self._held)

    def available(self) -> int:
        """Windows left in the held chunks."""
        return sum(self.windows_per_chunk - p for p in self._held.values())

    def wanted(self) -> int:
        """How many more chunks to lease to keep ``ahead`` unfinished chunks."""
        unfinished = sum(p < self.windows_per_chunk for p in self._held.values())
        return max(0, self.ahead - unfinished)

    def _window(self, chunk: int, pos: int) -> np.ndarray:
        perm = self._perms.get(chunk)
        if perm is None:
            perm = np.random.default_rng([self.seed, chunk]).permutation(self.windows_per_chunk)
            self._perms[chunk] = perm
        start = self.chunks[chunk][0] + int(perm[pos]) * (self.seq_len + 1)
        return self.tokens[start:start + self.seq_len + 1]

    def next_batch(self) -> torch.Tensor:
        """(batch_size, T+1) int64 windows, from the lowest held chunk with windows left; with
        :attr:`drain` set, the last windows even if fewer than a batch (then ``drain`` resets).

        Raises NoData (and consumes nothing) if fewer than batch_size windows are left (none
        at all when draining).
        """
        return self.read(self.next_windows(self.batch_size))

    def next_windows(self, count: int) -> list[tuple[int, int]]:
        """Take the next ``count`` windows as ``(chunk, position)`` pairs (positions advance),
        from the lowest held chunk with windows left; with :attr:`drain` set, the last windows
        even if fewer than ``count`` (then ``drain`` resets). The order depends only on the
        holdings, so every rank of a cluster holding the same state takes the same windows
        (:mod:`dips.train.ddp` splits them among ranks).

        Raises NoData (and consumes nothing) if fewer than ``count`` are left (none at all
        when draining).
        """
        left = self.available()
        if left < count and not (self.drain and left > 0):
            raise NoData(f"{left} windows left, a batch needs {count}")
        if left < count:
            self.drain = False
        out: list[tuple[int, int]] = []
        for chunk in sorted(self._held):
            while self._held[chunk] < self.windows_per_chunk and len(out) < count:
                out.append((chunk, self._held[chunk]))
                self._held[chunk] += 1
        return out

    def read(self, windows: list[tuple[int, int]]) -> torch.Tensor:
        """The token ids of ``windows`` ((chunk, position) pairs): (len, T+1) int64."""
        rows = [self._window(c, p) for c, p in windows]
        return torch.from_numpy(np.stack(rows).astype(np.int64))
