"""The token-weighted sum of one round's pseudo-gradients, formed at receipt (§8, §10 of the seed).

The outer update of a round needs δ = Σ_j w_j·Δ_j with w_j = T_j / Σ_k T_k over the accepted
clusters, and ‖δ‖² for the global clip. Formed when the leader asks (``aggregate``), that is a
pass over K pseudo-gradients and another over δ on the update's critical path, while the
clusters wait. :class:`RoundSum` forms S = Σ_j T_j·Δ_j instead, as each pushed layer is
complete (on the follower's data-consumer thread, while later layers still arrive): every
block of S is recomputed from all of its contributors' Δ in cluster-id order, so S does not
depend on the order in which pushes arrived, and ‖S_b‖² is kept per block. When the accepted
set is exactly the round's contributors and the leader's weights are T_j/ΣT — the normal case —
δ = S/ΣT and ‖δ‖² = Σ_b ‖S_b‖² / (ΣT)² are ready, and the follower's update is only the
Nesterov step with 1/ΣT folded into its gradient scale. Otherwise (a rejected or incomplete
push, the uniform-weights ablation, a push without a token count) :meth:`RoundSum.mean` returns
None and the follower forms δ with :func:`dips.algo.weighted_mean` as before.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from dips.algo import squared_norm
from dips.algo.aggregate import NORM_CHUNK

# Relative tolerance when matching the leader's weights to T_j / ΣT (both come from the
# same integers; only float division rounding differs).
_WEIGHT_TOL = 1e-12
_MAX_TOKENS = 2**63 - 1  # int64, as every count on the control plane


def blocks_of(numel: int) -> list[tuple[int, int]]:
    """The (start, stop) element ranges of a tensor's blocks (``NORM_CHUNK`` elements each)."""
    return [(s, min(s + NORM_CHUNK, numel)) for s in range(0, numel, NORM_CHUNK)] or [(0, 0)]


class RoundSum:
    """S = Σ_j T_j·Δ_j of one round on one shard, built layer by layer as pushes complete.

    Args:
        shapes: ``{param name: shape}`` of the shard, in the shard's tensor order.
        acquire: returns a set of FP32 buffers of those shapes (contents undefined), e.g.
            :meth:`dips.wire.pool.TensorPool.acquire`; called once, when a block first has two
            contributors (a round with one push never allocates).
        release: takes the buffers back (:meth:`close`).

    Not thread-safe: the follower calls it under its lock.
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]],
                 acquire: Callable[[], dict[str, torch.Tensor]],
                 release: Callable[[dict[str, torch.Tensor]], None]) -> None:
        self._blocks = {n: blocks_of(math.prod(s)) for n, s in shapes.items()}
        self._total = sum(len(b) for b in self._blocks.values())
        self._acquire, self._release = acquire, release
        self._buf: dict[str, torch.Tensor] | None = None
        self.tokens: dict[str, int] = {}
        self._done: dict[str, set[tuple[str, int]]] = {}
        self._contrib: dict[tuple[str, int], list[str]] = {}
        self._sq: dict[tuple[str, int], float] = {}
        self.unusable: str | None = None

    def announce(self, cluster: str, tokens: object) -> None:
        """Record T_j (the admission ticket's, or a trusted caller's header's); a missing or
        inconsistent count disables the sum.

        Raises ValueError if ``tokens`` is present but not an int in [1, 2**63 - 1] (header
        field 'tokens').
        """
        if tokens is None:
            self.unusable = self.unusable or f"push of {cluster!r} carries no 'tokens'"
            return
        if type(tokens) is not int or not 0 < tokens <= _MAX_TOKENS:
            raise ValueError(f"push header field 'tokens' = {repr(tokens)[:40]} is not an int "
                             f"in [1, 2**63 - 1]")
        if self.tokens.setdefault(cluster, tokens) != tokens:
            self.unusable = (f"cluster {cluster!r} announced tokens {self.tokens[cluster]} "
                             f"and {tokens}")

    def layer_done(self, cluster: str, names: list[str],
                   delta_of: Callable[[str, str], torch.Tensor]) -> None:
        """Include ``cluster``'s complete Δ of the tensors ``names`` in S.

        ``delta_of(cluster, name)`` returns a contributor's FP32 Δ of that tensor (contiguous).
        Each block of S with two or more contributors is recomputed from scratch in cluster-id
        order (T-weighted), then its ‖S_b‖² taken while it is in cache.
        """
        if self.unusable is not None or cluster not in self.tokens:
            self.unusable = self.unusable or f"push of {cluster!r} carries no 'tokens'"
            return
        done = self._done.setdefault(cluster, set())
        for name in names:
            for start, stop in self._blocks[name]:
                key = (name, start)
                done.add(key)
                contrib = self._contrib.setdefault(key, [])
                if cluster not in contrib:
                    contrib.append(cluster)
                    contrib.sort()
                if len(contrib) < 2:
                    continue
                if self._buf is None:
                    self._buf = self._acquire()
                out = self._buf[name].view(-1)[start:stop]
                first, *rest = contrib
                torch.mul(delta_of(first, name).view(-1)[start:stop], float(self.tokens[first]),
                          out=out)
                for c in rest:
                    out.add_(delta_of(c, name).view(-1)[start:stop], alpha=float(self.tokens[c]))
                self._sq[key] = squared_norm([out])

    def mean(self, clusters: list[str], weights: list[float],
             names: list[str]) -> tuple[list[torch.Tensor], float, float] | None:
        """(S's tensors in ``names`` order, 1/ΣT, ‖δ‖²) if S serves this accepted set, else None.

        Serves when at least two clusters are accepted, they are exactly the round's
        contributors, each contributed every block, and ``weights`` equal T_j/ΣT. Then
        δ = S·(1/ΣT) (the scale is for the caller to fold into the Nesterov step).
        """
        if self.unusable is not None or self._buf is None or len(clusters) < 2:
            return None
        if set(self._done) != set(clusters):
            return None
        if any(len(self._done[c]) != self._total for c in clusters):
            return None
        total = sum(self.tokens[c] for c in clusters)
        for c, w in zip(clusters, weights):
            if abs(w - self.tokens[c] / total) > _WEIGHT_TOL * max(1.0, abs(w)):
                return None
        sq = 0.0
        for key in sorted(self._sq):  # a fixed order: equal inputs give equal sums
            sq += self._sq[key]
        return [self._buf[n] for n in names], 1.0 / total, sq / (total * total)

    def close(self) -> None:
        """Give the buffers back (idempotent)."""
        if self._buf is not None:
            self._release(self._buf)
            self._buf = None
