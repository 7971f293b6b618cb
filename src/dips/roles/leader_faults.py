"""The leader's faults of the last hour (issue 15: ``GetStatus``, ``dips status``).

:class:`RecentFaults` keeps the faults of every record the leader writes
(:func:`dips.algo.faultlog.faults_of` on its ``leader_events.jsonl`` and ``outer_steps.jsonl``
lines: members removed, followers down or restarted, pushes rejected by reason, rollbacks,
commits that failed, its own restarts) in a bounded :class:`dips.algo.faultlog.FaultLog`. A
restarted leader first reads the last hour back from the tails of those files (only the tail:
a weeks-long run's files are not read whole), so the faults of the last hour survive its
restarts, its own restart included.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from dips.algo.faultlog import FAULT_WINDOW_S, Fault, FaultLog, faults_of

#: The files a leader's faults come from (streams of :meth:`Records._observe`).
STREAMS = ("leader_events", "outer_steps")


def _time_of(line: bytes) -> float | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    t = rec.get("time") if isinstance(rec, dict) else None
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None


def tail_records(path: Path, since: float, block: int = 1 << 16) -> list[dict[str, Any]]:
    """The JSON-object records of ``path`` whose ``time`` (epoch s) is at or after ``since``,
    reading the file backwards in ``block``-byte steps until a record older than ``since``
    (records are appended in about time order) or the file's start. A line that is not a
    JSON object (e.g. cut by a crash) is skipped; a missing file has none."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return []
    with f:
        pos = f.seek(0, 2)
        data = b""
        while pos > 0:
            step = min(block, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
            lines = data.split(b"\n")
            first = next((t for line in lines[1 if pos > 0 else 0:]
                          if (t := _time_of(line)) is not None), None)
            if first is not None and first < since:
                break
    out = []
    for line in data.split(b"\n")[1 if pos > 0 else 0:]:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        t = rec.get("time") if isinstance(rec, dict) else None
        if isinstance(t, (int, float)) and not isinstance(t, bool) and t >= since:
            out.append(rec)
    return out


class RecentFaults:
    """The leader's faults (see the module docstring); safe from any thread.

    Args:
        run_dir: the leader's state directory to read the last ``window_s`` back from (None:
            nothing to read).
        now: epoch seconds at creation (the window read back ends here).
        window_s: seconds of history (default one hour).
    """

    def __init__(self, run_dir: Path | None, now: float,
                 window_s: float = FAULT_WINDOW_S) -> None:
        self._lock = threading.Lock()
        self.log = FaultLog(window_s)
        if run_dir is not None:
            for stream in STREAMS:
                for rec in tail_records(run_dir / f"{stream}.jsonl", now - window_s):
                    self.log.add(faults_of(stream, rec))

    def note(self, stream: str, record: dict[str, Any]) -> None:
        """Take the faults of one record the leader wrote (stream: file name sans suffix)."""
        found = faults_of(stream, record)
        if found:
            with self._lock:
                self.log.add(found)

    def recent(self, now: float) -> tuple[list[Fault], dict[tuple[str, str], int], float]:
        """(faults of the window ending at ``now`` newest first, their counts by (kind,
        reason), the window in seconds)."""
        with self._lock:
            return self.log.recent(now), self.log.counts(now), self.log.window_s
