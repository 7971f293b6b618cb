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
from pathlib import Path
from typing import Any

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

