"""The leader's metadata checkpoint, ``leader.json`` (§12: < 100 KB; here a few KB).

Written atomically and durably (temporary file, fsync, rename, fsync of the directory, so
the rename itself survives a power loss) whenever a round opens, after every decision and
round; read when a restarted leader resumes. It is written before each round's decision line
of ``outer_steps.jsonl`` and carries that line (``unlogged``) until it is written: a leader
that died between the two writes resumes with the round and writes the line
(:func:`last_decision_round` says whether it is there).
"""

from __future__ import annotations

import json
import os
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
            if end > 0:
                tail = lines.pop(0)  # may be cut: read again with the block before it
            else:
                tail = b""
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
