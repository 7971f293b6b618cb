"""When a run ends: the token budget, an outer-step limit or a time limit (§6 of the seed).

§6's outer loop runs "while the tokens consumed < tks_max". The leader counts tokens only when
they enter the global model (the data-chunk ledger's accepted count, never what a member says
of itself), so the budget is reached when the accepted tokens reach it: the final model then
holds at least the budget, and work still in flight at that moment is not merged. The real
leader, ``dips launch`` and the virtual-time engine all decide with :func:`stop_reason`.

What a member may claim is bounded here too (issue 13: hostile peers): a push's T_j without a
ledger (:func:`push_tokens`), the chunks it may hold (:func:`lease_allowed`), and every count
the leader keeps saturates at int64 (:func:`saturating_add`), so no claim can overflow a
counter, break ``GetStatus`` or reach the budget except through accepted tokens.
"""

from __future__ import annotations

import math

__all__ = ["INT64_MAX", "lease_allowed", "push_tokens", "saturating_add", "stop_reason"]

#: The largest count the control plane carries (protobuf int64).
INT64_MAX = 2**63 - 1


def saturating_add(a: int, b: int) -> int:
    """``a + b`` kept within [0, :data:`INT64_MAX`] (counts never wrap or overflow)."""
    return min(max(a + b, 0), INT64_MAX)


def push_tokens(claimed: int, max_push_tokens: int | None) -> int:
    """T_j of a push in a run without a data ledger: the member's claim (tokens, >= 1) cut to
    ``max_push_tokens`` (the run's per-push maximum, :class:`dips.spec.LeaderConfig`; None:
    :data:`INT64_MAX`), so one member's weight in the mean (§6) is at most that of a full
    push. With a ledger the leader never asks: T_j is the ledger's count."""
    return min(claimed, max_push_tokens if max_push_tokens is not None else INT64_MAX)


def lease_allowed(held: int, wanted: int, lease_ahead: int | None,
                  max_push_tokens: int | None, tokens_per_window: int,
                  windows_per_chunk: int) -> int:
    """How many of ``wanted`` more chunks a member holding ``held`` may lease (>= 0).

    An honest member keeps ``lease_ahead`` unfinished chunks and holds, besides, the chunks it
    finished since its last verdict (they stay held until accepted): at most the windows of
    one push, ``max_push_tokens / tokens_per_window``, spread over chunks of
    ``windows_per_chunk`` windows, plus one it is part-way through. A member asking for more
    would starve the others of data; it gets none beyond the bound. ``lease_ahead`` None: no
    bound.
    """
    if lease_ahead is None:
        return max(wanted, 0)
    per_push = (max_push_tokens or 0) // max(tokens_per_window, 1)
    bound = lease_ahead + math.ceil(per_push / max(windows_per_chunk, 1)) + 1
    return max(0, min(wanted, bound - held))


def stop_reason(*, tokens_accepted: int, outer_steps: int, training_s: float | None,
                token_budget: int | None, max_outer_steps: int | None = None,
                max_time_s: float | None = None) -> str | None:
    """Why the run stops now, or None while it goes on.

    Args:
        tokens_accepted: tokens in the global model (accepted pushes' T_j), tokens.
        outer_steps: versions applied so far.
        training_s: seconds since training began (the first push request), None before.
        token_budget: stop once ``tokens_accepted >= token_budget`` (None: no budget).
        max_outer_steps: stop once ``outer_steps >= max_outer_steps`` (None: no limit).
        max_time_s: stop once ``training_s >= max_time_s`` seconds (None: no limit).

    Returns:
        ``"token budget"``, ``"max outer steps"``, ``"max time"`` (checked in that order), or
        None.
    """
    if token_budget is not None and tokens_accepted >= token_budget:
        return "token budget"
    if max_outer_steps is not None and outer_steps >= max_outer_steps:
        return "max outer steps"
    if max_time_s is not None and training_s is not None and training_s >= max_time_s:
        return "max time"
    return None
