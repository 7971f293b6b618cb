"""Which version every follower must hold after a failure (§12 of the seed; DESIGN.md
invariant: an outer step is applied by all followers or by none).

Each follower reports its current (committed) version, the version it has prepared but not
committed (phase 1 of the two-phase outer step, or -1), and the versions of its complete
checkpoints on disk. The target is chosen so that no follower ever needs data it lacks:

1. Roll forward: if the newest version V anyone holds (committed or prepared) is held by
   every follower, committed or prepared, the target is V (commit where only prepared) —
   but never above the leader's last durably recorded decision.
2. Otherwise roll back to the newest version every follower can reach: its committed
   version, its prepared one, or one of its checkpoints. Versions above it are lost.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass


class ReconcileError(RuntimeError):
    """No version is reachable by every follower (would need a lost checkpoint)."""


@dataclass(frozen=True)
class FollowerReport:
    """One follower's state. Versions are outer-step counters (>= 0); prepared = -1: none."""

    index: int
    version: int
    prepared: int = -1
    checkpoints: tuple[int, ...] = ()


def reconcile_target(reports: list[FollowerReport], cap: int | None = None) -> int:
    """The version every follower must be brought to (see module docstring).

    A follower can reach its committed version, its prepared version (by committing it) and
    any checkpointed version (by loading it). The target is the newest version every
    follower can reach, not above ``cap`` (the leader's last durably decided version: a
    step the leader has not recorded must not be rolled forward).

    Raises:
        ValueError: no reports, or a negative committed version.
        ReconcileError: no common reachable version.
    """
    if not reports:
        raise ValueError("reconcile_target: no follower reports")
    for r in reports:
        if r.version < 0:
            raise ValueError(f"follower {r.index}: field 'version' = {r.version} is negative")
    reach = [{r.version, *r.checkpoints} | ({r.prepared} if r.prepared >= 0 else set())
             for r in reports]
    common = {v for v in set.intersection(*reach) if cap is None or v <= cap}
    if not common:
        raise ReconcileError("no version reachable by every follower"
                             + (f" at or below {cap}" if cap is not None else "") + ": "
                             + "; ".join(f"follower {r.index}: version {r.version}, prepared "
                                         f"{r.prepared}, checkpoints {list(r.checkpoints)}"
                                         for r in reports))
    return max(common)
