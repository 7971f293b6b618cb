"""Where the processes of ``dips launch`` serve their metrics: ``RUN_DIR/metrics.json``
(``{"leader": "127.0.0.1:PORT", "follower-0": ..., "cluster-c0": ...}``, README "Metrics").

Each role binds a free port itself (``--metrics-port 0``) and writes the address it got to
its state directory (:data:`dips.roles.durable.METRICS_ADDR`): a port chosen beforehand by the
launcher could be taken by another process before the role bound it (a follower exited so
under load). :class:`MetricsTargets` collects those files into ``metrics.json``, rewritten
whenever one appears or changes (a restarted role binds another port).
"""

from __future__ import annotations

import json
from pathlib import Path

from dips.roles.durable import METRICS_ADDR, write_atomic

__all__ = ["MetricsTargets"]


class MetricsTargets:
    """``metrics.json`` of ``run_dir`` from the roles' state directories.

    Args:
        run_dir: the run directory (``metrics.json`` goes there).
        state_dirs: process name -> its ``--state-dir``.
    """

    def __init__(self, run_dir: Path, state_dirs: dict[str, Path]) -> None:
        self.path = run_dir / "metrics.json"
        self.state_dirs = dict(state_dirs)
        self.targets: dict[str, str] = {}

    @classmethod
    def from_args(cls, run_dir: Path, args: dict[str, list[str]]) -> "MetricsTargets":
        """The targets of the role commands ``args`` (name -> argv with ``--state-dir``)."""
        return cls(run_dir, {n: Path(a[a.index("--state-dir") + 1]) for n, a in args.items()})

    def refresh(self) -> dict[str, str]:
        """Read every role's address file (a role not yet serving has none) and rewrite
        ``metrics.json`` if anything changed; returns the targets known (name -> HOST:PORT).
        Raises OSError only for a metrics.json that cannot be written."""
        known: dict[str, str] = {}
        for name, state in self.state_dirs.items():
            try:
                addr = (state / METRICS_ADDR).read_text().strip()
            except OSError:  # not serving yet
                continue
            if addr:
                known[name] = addr
        if known != self.targets or not self.path.exists():
            self.targets = known
            write_atomic(self.path, json.dumps(known, indent=1).encode())
        return known
