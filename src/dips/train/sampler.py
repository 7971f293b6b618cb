"""Data chunks and the per-cluster batch sampler (re-exported by :mod:`dips.train.corpus`).

Source: §12 of the seed — production pre-cuts the data into many more chunks than clusters so
that a changing number of clusters still receives balanced, representative data.  Here the
train token stream is cut into contiguous chunks (:func:`make_chunks`), chunks are dealt to
clusters round-robin (:func:`assign_chunks`), and each cluster draws fixed-length windows only
from its own chunks (:class:`BatchSampler`).  Pure numpy/torch; no I/O, no wall clock.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["BatchSampler", "assign_chunks", "make_chunks"]


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or int(value) <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def make_chunks(n_tokens: int, num_chunks: int) -> list[tuple[int, int]]:
    """Cut ``[0, n_tokens)`` into ``num_chunks`` contiguous half-open ``(start, end)`` chunks.

    Chunk i is ``[i*n_tokens//num_chunks, (i+1)*n_tokens//num_chunks)``: the chunks are disjoint,
    in order, cover every token exactly once, and their lengths differ by at most one token.
    §12: pick ``num_chunks`` much larger than the number of clusters.

    Args:
        n_tokens: length of the train stream (tokens), > 0.
        num_chunks: number of chunks, 1 … n_tokens.

    Raises:
        ValueError: non-positive ``n_tokens``/``num_chunks`` or ``num_chunks > n_tokens``.
    """
    n = _positive_int("n_tokens", n_tokens)
    k = _positive_int("num_chunks", num_chunks)
    if k > n:
        raise ValueError(f"num_chunks must be <= n_tokens={n}, got {num_chunks!r}")
    bounds = [i * n // k for i in range(k + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(k)]


def assign_chunks(num_chunks: int, clusters: list[str]) -> dict[str, list[int]]:
    """Deal chunk ids ``0 … num_chunks-1`` to ``clusters`` round-robin, in the given order.

    Cluster ``clusters[j]`` gets chunk ids ``j, j+n, j+2n, …`` (n = len(clusters)), ascending.
    The result is disjoint, covers every chunk once and depends only on the arguments.

    Raises:
        ValueError: ``clusters`` empty, not all non-empty strings, or with duplicates;
            ``num_chunks`` not a positive int or smaller than ``len(clusters)`` (a cluster
            would get no data).
    """
    k = _positive_int("num_chunks", num_chunks)
    names = list(clusters)
    if not names or not all(isinstance(c, str) and c for c in names):
        raise ValueError(f"clusters must be a non-empty list of non-empty str, got {clusters!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"clusters must be unique, got {clusters!r}")
    if k < len(names):
        raise ValueError(f"num_chunks must be >= len(clusters)={len(names)}, got {num_chunks!r}")
    return {name: list(range(j, k, len(names))) for j, name in enumerate(names)}


class BatchSampler:
    """Deterministic batches of token windows drawn only from a cluster's assigned chunks.

    One *epoch* visits the assigned chunks in an order shuffled with ``(seed, epoch)``; inside
    a chunk of length L it cuts ``L // (seq_len+1)`` non-overlapping windows of ``seq_len+1``
    tokens after a random offset in ``[0, L mod (seq_len+1)]`` and visits them in shuffled
    order.  So within one epoch every window lies inside one chunk (never crossing a chunk
    boundary) and no token is drawn twice; consecutive windows fill batches, so a batch may
    span two chunks or two epochs.  The stream of batches depends only on the arguments
    (numpy ``default_rng([seed, epoch])``), never on global RNG state.

    Args:
        tokens: 1-D integer array of token ids (the train stream; any integer dtype).
        chunks: all chunks as ``(start, end)`` half-open token ranges (from :func:`make_chunks`).
        chunk_ids: indices into ``chunks`` owned by this cluster (from :func:`assign_chunks`).
        batch_size: windows per batch, > 0.
        seq_len: tokens trained on per window, > 0; each window holds ``seq_len + 1`` ids.
        seed: non-negative int.

    Raises:
        ValueError: any argument malformed; a chunk outside ``tokens``; duplicate or
            out-of-range ``chunk_ids``; an assigned chunk shorter than ``seq_len + 1`` tokens.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        chunks: list[tuple[int, int]],
        chunk_ids: list[int],
        batch_size: int,
        seq_len: int,
        seed: int,
    ) -> None:
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}")
        self._batch_size = _positive_int("batch_size", batch_size)
        self._seq_len = _positive_int("seq_len", seq_len)
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self._seed = int(seed)
        ids = [int(i) for i in chunk_ids]
        if not ids or len(set(ids)) != len(ids) or not all(0 <= i < len(chunks) for i in ids):
            raise ValueError(f"chunk_ids must be unique indices into chunks (0..{len(chunks) - 1}), got {chunk_ids!r}")
        width = self._seq_len + 1
        self._spans: list[tuple[int, int]] = []
        for i in ids:
            start, end = (int(x) for x in chunks[i])
            if not 0 <= start < end <= tokens.size:
                raise ValueError(f"chunks[{i}]={chunks[i]!r} is not inside tokens of length {tokens.size}")
            if end - start < width:
                raise ValueError(
                    f"chunks[{i}]={chunks[i]!r} has {end - start} tokens, fewer than seq_len+1={width}"
                )
            self._spans.append((start, end))
        self._tokens = tokens
        self._windows_per_epoch = sum((e - s) // width for s, e in self._spans)
        self._epoch = -1
        self._plan = np.empty(0, dtype=np.int64)
        self._cursor = 0

    @property
    def tokens_per_batch(self) -> int:
        """Tokens trained on per inner step: ``batch_size * seq_len`` (tokens)."""
        return self._batch_size * self._seq_len

    @property
    def windows_per_epoch(self) -> int:
        """Number of ``seq_len + 1``-token windows in one pass over the assigned chunks."""
        return self._windows_per_epoch

    @property
    def epoch(self) -> int:
        """Epoch the next window comes from (0-based; passes over the assigned chunks)."""
        return self._epoch if self._cursor < self._plan.size else self._epoch + 1

    def _epoch_plan(self, epoch: int) -> np.ndarray:
        """Window start offsets (int64, into ``tokens``) for one epoch, in visiting order."""
        rng = np.random.default_rng([self._seed, epoch])
        width = self._seq_len + 1
        starts = []
        for k in rng.permutation(len(self._spans)):
            start, end = self._spans[k]
            n = (end - start) // width
            offset = int(rng.integers(0, (end - start) - n * width + 1))
            starts.append(start + offset + width * rng.permutation(n).astype(np.int64))
        return np.concatenate(starts)

    def next_batch(self) -> torch.Tensor:
        """Next batch: int64 tensor of shape ``(batch_size, seq_len + 1)`` (token ids).

        Row r is ``tokens[s_r : s_r + seq_len + 1]`` for a window start ``s_r`` inside one
        assigned chunk; inputs are ``[:, :-1]`` and next-token labels ``[:, 1:]``.
        """
        starts = np.empty(self._batch_size, dtype=np.int64)
        filled = 0
        while filled < self._batch_size:
            if self._cursor >= self._plan.size:
                self._epoch += 1
                self._plan = self._epoch_plan(self._epoch)
                self._cursor = 0
            take = min(self._batch_size - filled, self._plan.size - self._cursor)
            starts[filled : filled + take] = self._plan[self._cursor : self._cursor + take]
            self._cursor += take
            filled += take
        index = starts[:, None] + np.arange(self._seq_len + 1, dtype=np.int64)[None, :]
        return torch.from_numpy(self._tokens[index].astype(np.int64))
