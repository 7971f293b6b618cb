"""The leader's metadata checkpoint, ``leader.json`` (§12: < 100 KB; here a few KB).

Written atomically (temporary file, fsync, rename) after every decision and round; read when
a restarted leader resumes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def save_state(path: Path, state: dict[str, Any]) -> None:
    """Write the leader's metadata checkpoint atomically (tmp file + fsync + rename)."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_state(path: Path) -> dict[str, Any] | None:
    """The leader's last checkpoint, or None if there is none. Raises ValueError if corrupt."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"leader checkpoint {path} is corrupt: {exc}") from None
