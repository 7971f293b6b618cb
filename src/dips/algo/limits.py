"""When a run ends: the token budget, an outer-step limit or a time limit (§6 of the seed).

§6's outer loop runs "while the tokens consumed < tks_max". The leader counts tokens only when
they enter the global model (the data-chunk ledger's accepted count, never what a member says
of itself), so the budget is reached when the accepted tokens reach it: the final model then
holds at least the budget, and work still in flight at that moment is not merged. The real
leader, ``dips launch`` and the virtual-time engine all decide with :func:`stop_reason`.
"""

from __future__ import annotations

__all__ = ["stop_reason"]


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
