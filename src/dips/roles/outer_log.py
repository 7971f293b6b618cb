"""The lines of the leader's ``outer_steps.jsonl`` (README "Outputs"): what a round's line
counts, and reading the end of the file when a restarted leader resumes.

A round's pushes withdrawn because their clusters left the run gracefully (stopped, or the
run finished) or were removed after it finished (code ``withdrawn``) are not rejections: its line lists them under ``withdrawn``, outside the
``clusters``, ``rejected`` and ``tokens`` every reader counts (the summary, the report, the
metrics, ``dips status``; review 33 of issue 15, m3). ``leader.json`` carries a round's line
until it is written (:mod:`dips.roles.leader_records`); :func:`last_decision_round` tells a
resumed leader whether it was.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dips.algo.round import RejectCode
from dips.roles.outer_step import UpdateReport

__all__ = ["end_torn_line", "last_decision_round", "set_apart", "withdrawn"]


def withdrawn(report: UpdateReport) -> set[str]:
    """The clusters of a round whose push was withdrawn, not rejected: they left gracefully,
    or were removed after the run finished (code ``withdrawn``; review 33 of issue 15, m3)."""
    out = report.outcome
    return {c for c in report.clusters if c not in out.accepted
            and out.code_of(c) == RejectCode.WITHDRAWN.value}


def set_apart(record: dict[str, Any], gone: set[str]) -> dict[str, Any]:
    """A round's line with the withdrawn pushes ``gone`` out of ``clusters``, ``rejected``
    and ``tokens`` (what every reader counts) and in ``withdrawn`` (cluster -> ``reason``,
    ``tokens``)."""
    if not gone:
        return record
    rejected = record.get("rejected") or {}
    tokens = record.get("tokens") or {}
    return {**record, "clusters": [c for c in record["clusters"] if c not in gone],
            "rejected": {c: w for c, w in rejected.items() if c not in gone},
            "tokens": {c: t for c, t in tokens.items() if c not in gone},
            "withdrawn": {c: {"reason": (rejected.get(c) or {}).get("reason"),
                              "tokens": tokens.get(c, 0)} for c in sorted(gone)}}


#: Bytes read at a time from the end of ``outer_steps.jsonl`` (a decision line is a few KB).
_TAIL_BLOCK = 1 << 16


def last_decision_round(path: Path) -> int | None:
    """The round of the last decision line of ``outer_steps.jsonl`` at ``path`` (a line
    with ``accepted`` and no ``event``), reading from the end; None when it has none (or no
    file). Lines that are not JSON objects (one torn by a crash) are skipped."""
    if not path.exists():
        return None
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        tail = b""
        while end > 0:
            start = max(0, end - _TAIL_BLOCK)
            f.seek(start)
            tail = f.read(end - start) + tail
            end = start
            lines = tail.split(b"\n")
            # The first piece may be cut: it is read again with the block before it.
            tail = lines.pop(0) if end > 0 else b""
            for line in reversed(lines):
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if (isinstance(rec, dict) and "accepted" in rec and "event" not in rec
                        and isinstance(rec.get("round"), int)):
                    return rec["round"]
    return None


def end_torn_line(path: Path) -> None:
    """End the last line of the JSON-lines file at ``path`` if a crash cut it (no newline
    at the end), so that lines appended next stay whole; no file or an empty one: nothing."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            f.write(b"\n")
