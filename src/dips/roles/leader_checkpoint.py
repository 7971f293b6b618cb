"""The leader's metadata checkpoint, ``leader.json`` (§12: < 100 KB; here a few KB).

Written atomically and durably (temporary file, fsync, rename, fsync of the directory, so
the rename itself survives a power loss) whenever a round opens, after every decision and
round; read when a restarted leader resumes. It is written before each round's decision line
of ``outer_steps.jsonl`` and carries that line (``unlogged``) until it is written: a leader
that died between the two writes resumes with the round and writes the line
(:func:`dips.roles.outer_log.last_decision_round` says whether it is there).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dips.algo.limits import INT64_MAX

from dips.roles.durable import write_atomic


def save_state(path: Path, state: dict[str, Any]) -> None:
    """Write the leader's metadata checkpoint atomically and durably
    (:func:`dips.roles.durable.write_atomic`). Raises OSError."""
    write_atomic(path, json.dumps(state, separators=(",", ":")).encode())


def load_state(path: Path) -> dict[str, Any] | None:
    """The leader's last checkpoint, or None if there is none. Raises ValueError if corrupt."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"leader checkpoint {path} is corrupt: {exc}") from None


def progress_state(entry: Any) -> dict[str, Any]:
    """A member's progress (a ``ClusterEntry``: its last heartbeat and pull) as
    ``leader.json`` keeps it, for ``dips status`` after a restart (:func:`progress_of`)."""
    return {"inner_step": entry.inner_step, "tokens": entry.tokens,
            "pulled_version": entry.pulled_version, "last_push": entry.last_push,
            "last_loss": entry.last_loss if math.isfinite(entry.last_loss) else None}


def progress_of(kept: Any) -> dict[str, Any]:
    """A member's progress as ``leader.json`` kept it, as ``ClusterEntry`` fields: a restarted
    leader shows it until the member's next heartbeat and pull, instead of zeros and nulls
    (review 33 of issue 15, m1); {} for none (an older file)."""
    if not isinstance(kept, dict):
        return {}
    loss = kept.get("last_loss")
    return {"inner_step": min(max(int(kept.get("inner_step", 0)), 0), INT64_MAX),
            "tokens": min(max(int(kept.get("tokens", 0)), 0), INT64_MAX),
            "pulled_version": max(int(kept.get("pulled_version", -1)), -1),
            "last_push": str(kept.get("last_push", "-")),
            "last_loss": float(loss) if isinstance(loss, (int, float)) else float("nan")}
