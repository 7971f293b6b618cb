"""Where the processes of ``dips launch`` serve their metrics: ``RUN_DIR/metrics.json``
(``{"leader": "127.0.0.1:PORT", "follower-0": ..., "cluster-c0": ...}``, README "Metrics"),
and the same targets as a Prometheus ``file_sd_configs`` file, ``RUN_DIR/metrics_sd.json``.

Each role binds a free port itself (``--metrics-port 0``) and writes the address it got to
its state directory (:data:`dips.roles.durable.METRICS_ADDR`): a port chosen beforehand by the
launcher could be taken by another process before the role bound it (a follower exited so
under load). :class:`MetricsTargets` collects those files into both files, rewritten
whenever one appears or changes: a restarted role binds another port (review 33 m2), and
until its new process serves, the files keep the dead one's address, so a scrape of it
fails (Prometheus ``up`` 0 for that member) rather than the target vanishing. In the
``file_sd`` file each target carries the labels ``member`` (the process name: stable across
restarts, unlike the address) and ``role`` (``leader``, ``follower``, ``cluster``,
``evaluator``); Prometheus re-reads the file when it changes.
"""

from __future__ import annotations

import json
from pathlib import Path

from dips.roles.durable import METRICS_ADDR, write_atomic

__all__ = ["FILE_SD", "MetricsTargets", "file_sd", "role_of"]

#: The Prometheus file_sd targets file in the run directory.
FILE_SD = "metrics_sd.json"


def role_of(name: str) -> str:
    """The role of launcher process ``name``: ``cluster-a`` -> ``cluster``, ``follower-0`` ->
    ``follower``, ``leader``, ``evaluator``."""
    return name.split("-", 1)[0]


def file_sd(targets: dict[str, str]) -> list[dict[str, object]]:
    """``targets`` (name -> HOST:PORT) as Prometheus file_sd target groups, one per process,
    labelled ``member`` and ``role`` (module docstring), in name order."""
    return [{"targets": [addr], "labels": {"member": name, "role": role_of(name)}}
            for name, addr in sorted(targets.items())]


class MetricsTargets:
    """``metrics.json`` of ``run_dir`` from the roles' state directories.

    Args:
        run_dir: the run directory (``metrics.json`` goes there).
        state_dirs: process name -> its ``--state-dir``.
    """

    def __init__(self, run_dir: Path, state_dirs: dict[str, Path]) -> None:
        self.path = run_dir / "metrics.json"
        self.sd_path = run_dir / FILE_SD
        self.state_dirs = dict(state_dirs)
        self.targets: dict[str, str] = {}

    @classmethod
    def from_args(cls, run_dir: Path, args: dict[str, list[str]]) -> "MetricsTargets":
        """The targets of the role commands ``args`` (name -> argv with ``--state-dir``)."""
        return cls(run_dir, {n: Path(a[a.index("--state-dir") + 1]) for n, a in args.items()})

    def refresh(self) -> dict[str, str]:
        """Read every role's address file (a role not yet serving has none) and rewrite
        ``metrics.json`` and ``metrics_sd.json`` if anything changed; returns the targets
        known (name -> HOST:PORT). Raises OSError only for a file that cannot be written."""
        known: dict[str, str] = {}
        for name, state in self.state_dirs.items():
            try:
                addr = (state / METRICS_ADDR).read_text().strip()
            except OSError:  # not serving yet
                continue
            if addr:
                known[name] = addr
        if known != self.targets or not self.path.exists() or not self.sd_path.exists():
            self.targets = known
            write_atomic(self.path, json.dumps(known, indent=1).encode())
            write_atomic(self.sd_path, json.dumps(file_sd(known), indent=1).encode())
        return known
