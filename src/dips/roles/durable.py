"""Durable files: what a crash or power loss must not leave half-written or lost.

A rename is atomic but not durable until the directory holding it is flushed, and a file's
bytes are not durable until the file is (POSIX ``fsync(2)``; ext4 and XFS lose a renamed
file's contents on power loss otherwise). Every state file a role persists — shard
checkpoints, ``leader.json``, terms, a follower's used push ids — goes through these functions.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush ``path`` (a file or a directory) to stable storage. Raises OSError."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: The file in a role's state directory that says where it serves its metrics (``HOST:PORT``,
#: written by :func:`dips.node.metrics.serve_metrics`; read by ``dips launch``).
METRICS_ADDR = "metrics.addr"


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically and durably: a temporary file in the same
    directory, created with ``mode`` (never wider, whatever the umask), fsynced, renamed over
    ``path``, then the directory fsynced. Readers see the old or the new bytes, never a mix.
    Raises OSError."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)
        _write_all(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_path(path.parent)


def append_durable(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Append ``data`` to ``path`` (created with ``mode`` if missing) and flush it; a new
    file's directory entry is flushed too. A crash may leave a cut tail: readers must drop an
    incomplete last record. Raises OSError."""
    created = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
    try:
        _write_all(fd, data)
    finally:
        os.close(fd)
    if created:
        fsync_path(path.parent)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.fsync(fd)
