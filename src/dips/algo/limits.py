"""When a run ends: the token budget, an outer-step limit or a time limit (§6 of the seed).

§6's outer loop runs "while the tokens consumed < tks_max". The leader counts tokens only when
they enter the global model (the data-chunk ledger's accepted count, never what a member says
of itself), so the budget is reached when the accepted tokens reach it: the final model then
holds at least the budget, and work still in flight at that moment is not merged. The real
leader, ``dips launch`` and the virtual-time engine all decide with :func:`stop_reason`.

What a member may claim is bounded here too (issue 13: hostile peers): a push's T_j without a
ledger (:func:`push_tokens`), the base version its staleness is counted from
(:func:`push_base_version`), how often it may re-join (:func:`join_allowed`), the chunks it
may hold (:func:`lease_allowed`), and every count
the leader keeps saturates at int64 (:func:`saturating_add`), so no claim can overflow a
counter, break ``GetStatus`` or reach the budget except through accepted tokens.
"""

from __future__ import annotations

import math

__all__ = ["INT64_MAX", "JOIN_BURST", "JoinHistory", "join_allowed", "lease_allowed",
           "push_base_version", "push_tokens", "saturating_add", "stop_reason"]

#: One cluster's joins as the leader saw them: (seconds of its last join on the leader's
#: clock, re-joins in a row: each sooner than 2 × ``rejoin_max_s`` after the one before).
JoinHistory = tuple[float, int]

#: Joins in a row a cluster may make without waiting (:func:`join_allowed`).
JOIN_BURST = 4

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


def push_base_version(claimed: int, floor: int, version: int) -> int:
    """The base version a push is weighed from (§8: staleness s_j = version − base): the
    member's claim raised to ``floor``, the lowest version it can hold as the leader saw it
    (the version it joined at, each version a verdict of its told it to pull, each it reported
    pulled), itself cut to the leader's ``version`` (a rollback may lower it). A claim below
    what the member was given would inflate s_j, and with it the staleness scale
    1/(1 + Σ w_j s_j) that shrinks *every* member's step of that round (review 20: one member
    claiming base 0 at version 1,000 cut the others' progress to 0.003×). A claim above the
    floor is believed: it only lowers the member's own penalty. Versions are ints >= 0."""
    return max(claimed, min(floor, version))


def join_allowed(history: JoinHistory | None, now: float, min_s: float,
                 max_s: float) -> tuple[float, JoinHistory | None]:
    """Whether a cluster may (re-)join at ``now`` (seconds): returns (seconds it must still
    wait — 0.0: allowed — and its history after this join; the history is unchanged when it
    must wait).

    Joins come in a row while each is sooner than ``2 × max_s`` after the one before. The
    first :data:`JOIN_BURST` re-joins of a row are free (a client retries a join whose pull
    failed at once); the k-th after them must come at least ``min(min_s × 2^k, max_s)``
    seconds after the one before, so a flood gets one join per ``max_s`` (288 a day at 300 s). Each join re-keys the member and is written
    to the leader's event log: review 20 measured 1,489 joins/s from one member (13 GB of
    log a day, a 20-minute replay at restart). A cluster that crashes and restarts now and
    then re-joins at once; one that loops waits 1, 2, 4, ... s after a few, at most ``max_s``."""
    if history is None:
        return 0.0, (now, 0)
    last, streak = history
    wait = (0.0 if streak < JOIN_BURST else
            min(min_s * 2.0 ** min(streak - JOIN_BURST, 60), max_s) - (now - last))
    if wait > 0:
        return wait, history
    return 0.0, (now, streak + 1 if now - last < 2 * max_s else 0)


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
