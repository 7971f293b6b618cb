"""What the leader's ``outer_steps.jsonl`` counts, per cluster and in all (README "Outputs").

One rule, used by the launcher's ``summary.json`` (``per_cluster``: :func:`dips.emu.summary.
per_cluster`) and by ``dips report`` (``tokens_per_cluster.png``, and the key figures of a run
without ``summary.json`` or ``leader.json``), so the two always agree (issue 15: the report
once added every decision line's accepted tokens, a rolled-back step's included, and showed
more accepted per cluster than the summary).

The file holds, over every leader process: one decision line per round (``round``,
``clusters``, ``accepted``, ``rejected``, ``tokens``, ``version``), ``round_end`` lines and
``rollback`` lines (``version``: the version the followers were reconciled to, §12). So:

* a decision line counts each push of its round once: pushed (and its ``tokens``), accepted
  or rejected; a line repeated for a round already seen counts nothing;
* a line with accepted pushes applies its ``version``: one outer step;
* a ``rollback`` line to version t takes every version above t back: its accepted pushes
  leave ``updates_accepted`` and ``tokens_accepted`` for ``updates_lost``, its outer step
  leaves ``outer_steps`` for ``outer_steps_lost`` (as the leader's own counts do,
  :meth:`dips.roles.leader.Leader` reconcile); a version decided again after it counts anew.

Pure: records in (file order), numbers out (counts; tokens). Fields of another type are
skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

__all__ = ["PER_CLUSTER", "PushCounts", "leader_counts", "push_counts"]

#: The per-cluster counts of :func:`push_counts`.
PER_CLUSTER = ("updates_pushed", "updates_accepted", "updates_rejected", "updates_lost",
               "tokens_pushed", "tokens_accepted")


@dataclass
class PushCounts:
    """The counts of one ``outer_steps.jsonl``.

    Attributes:
        per_cluster: cluster id -> its :data:`PER_CLUSTER` counts (pushes; tokens), sorted
            by id; only clusters a decision line names.
        outer_steps: versions applied and not rolled back.
        outer_steps_lost: versions rolled back.
    """

    per_cluster: dict[str, dict[str, int]] = field(default_factory=dict)
    outer_steps: int = 0
    outer_steps_lost: int = 0

    def totals(self) -> dict[str, int]:
        """Each of :data:`PER_CLUSTER` summed over the clusters."""
        return {k: sum(row[k] for row in self.per_cluster.values()) for k in PER_CLUSTER}


def _tokens(rec: dict[str, Any]) -> dict[str, int]:
    per = rec.get("tokens")
    if not isinstance(per, dict):
        return {}
    return {str(c): int(t) for c, t in per.items()
            if isinstance(t, (int, float)) and not isinstance(t, bool)}


def _ids(value: Any) -> list[str]:
    return [str(c) for c in value] if isinstance(value, (list, dict)) else []


def push_counts(records: Iterable[dict[str, Any]]) -> PushCounts:
    """The counts of the ``outer_steps.jsonl`` ``records``, in file order (module docstring).
    Records that are not dicts, and lines neither a decision nor a ``rollback``, are skipped."""
    out: dict[str, dict[str, int]] = {}
    applied: dict[int, dict[str, int]] = {}  # version -> accepted cluster -> tokens
    rounds: set[Any] = set()
    lost = 0

    def row(cid: str) -> dict[str, int]:
        return out.setdefault(cid, dict.fromkeys(PER_CLUSTER, 0))

    for rec in records:
        if not isinstance(rec, dict):
            continue
        version = rec.get("version")
        if rec.get("event") == "rollback" and isinstance(version, int):
            for v in [v for v in applied if v > version]:
                lost += 1
                for cid, tokens in applied.pop(v).items():
                    r = row(cid)
                    r["updates_accepted"] -= 1
                    r["tokens_accepted"] -= tokens
                    r["updates_lost"] += 1
            continue
        if "event" in rec or "accepted" not in rec or rec.get("round") in rounds:
            continue
        rounds.add(rec.get("round"))
        tokens = _tokens(rec)
        accepted = _ids(rec.get("accepted"))
        for cid in _ids(rec.get("clusters")) or list(tokens):
            r = row(cid)
            r["updates_pushed"] += 1
            r["tokens_pushed"] += tokens.get(cid, 0)
        for cid in _ids(rec.get("rejected")):
            row(cid)["updates_rejected"] += 1
        for cid in accepted:
            r = row(cid)
            r["updates_accepted"] += 1
            r["tokens_accepted"] += tokens.get(cid, 0)
        if accepted and isinstance(version, int):
            applied[version] = {cid: tokens.get(cid, 0) for cid in accepted}
    return PushCounts(dict(sorted(out.items())), len(applied), lost)


def leader_counts(records: Iterable[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """:attr:`PushCounts.per_cluster` of :func:`push_counts`: per cluster, the counts of
    :data:`PER_CLUSTER` (pushes; tokens)."""
    return push_counts(records).per_cluster
