"""Follower shard checkpoints (§12 of the seed): parameters, Nesterov momentum and version.

Layout under a follower's checkpoint directory::

    v000042/shard.safetensors   θ as "param/<name>", momentum as "momentum/<name>" (FP32)
    v000042/meta.json           {"version": 42, "index": i, "checksum": ..., "names": [...]}

A checkpoint is *complete* once ``meta.json`` exists: the tensors are written first into a
temporary directory that is fsynced and renamed into place, and ``meta.json`` last (fsynced,
as is each directory), so a crash or power loss mid-write leaves nothing that looks complete. The newest K complete checkpoints are kept. Writing runs
in a background thread (:class:`CheckpointWriter`) on a private copy of the tensors, so the
follower never waits for the disk; :meth:`CheckpointWriter.wait` makes a version durable.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from dips.roles.durable import fsync_path, write_atomic

log = logging.getLogger(__name__)


def _dir(root: Path, version: int) -> Path:
    return root / f"v{version:06d}"


def complete_versions(root: Path) -> list[int]:
    """Versions with a complete checkpoint under ``root``, ascending."""
    if not root.exists():
        return []
    out = []
    for d in root.iterdir():
        if d.name.startswith("v") and d.name[1:].isdigit() and (d / "meta.json").exists():
            out.append(int(d.name[1:]))
    return sorted(out)


def save_checkpoint(root: Path, version: int, index: int, params: dict[str, torch.Tensor],
                    momenta: dict[str, torch.Tensor], checksum: str, keep: int) -> Path:
    """Write one complete checkpoint and prune to the newest ``keep``. Returns its directory."""
    final = _dir(root, version)
    if (final / "meta.json").exists():
        return final
    tmp = root / f".tmp-v{version:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {f"param/{n}": t for n, t in params.items()}
    tensors.update({f"momentum/{n}": t for n, t in momenta.items()})
    save_file(tensors, str(tmp / "shard.safetensors"))
    # The tensors are durable before the directory is renamed into place, and the rename
    # before meta.json marks the checkpoint complete (dips.roles.durable).
    fsync_path(tmp / "shard.safetensors")
    fsync_path(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    fsync_path(root)
    meta = {"version": version, "index": index, "checksum": checksum, "names": sorted(params)}
    write_atomic(final / "meta.json", json.dumps(meta).encode())
    for old in complete_versions(root)[:-keep]:
        shutil.rmtree(_dir(root, old), ignore_errors=True)
    return final


def load_checkpoint(root: Path, version: int, names: list[str]
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """(params, momenta, meta) of checkpoint ``version``.

    Raises FileNotFoundError if it is not complete, ValueError if its tensors do not match
    ``names`` exactly.
    """
    d = _dir(root, version)
    meta = json.loads((d / "meta.json").read_text())
    tensors = load_file(str(d / "shard.safetensors"))
    params = {k[len("param/"):]: v for k, v in tensors.items() if k.startswith("param/")}
    momenta = {k[len("momentum/"):]: v for k, v in tensors.items() if k.startswith("momentum/")}
    if sorted(params) != sorted(names) or sorted(momenta) != sorted(names):
        raise ValueError(f"checkpoint {d}: tensors {sorted(params)} do not match shard {sorted(names)}")
    if meta.get("version") != version:
        raise ValueError(f"checkpoint {d}: meta version {meta.get('version')} != {version}")
    return params, momenta, meta


class CheckpointWriter:
    """Writes checkpoints in one background thread, newest request wins.

    Args:
        root: checkpoint directory of this follower.
        index: follower index (recorded in meta.json).
        keep: complete checkpoints to keep (K >= 2, so a rollback target always exists).
        on_saved: called with (version, seconds the write took) after each complete
            checkpoint, on the writer's thread (``dips follower``'s metrics).
    """

    def __init__(self, root: Path, index: int, keep: int = 3,
                 on_saved: Callable[[int, float], None] | None = None) -> None:
        if keep < 2:
            raise ValueError(f"checkpoint keep = {keep} must be >= 2")
        self.root = root
        self.index = index
        self.keep = keep
        self._on_saved = on_saved
        self._cond = threading.Condition()
        self._job: tuple[int, dict, dict, str] | None = None
        self._written = max(complete_versions(root), default=-1)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="checkpoint", daemon=True)
        self._thread.start()

    def submit(self, version: int, params: dict[str, torch.Tensor],
               momenta: dict[str, torch.Tensor], checksum: str, copy: bool = True) -> None:
        """Queue a checkpoint of ``version`` (replacing a queued one not yet started).

        ``copy=True`` clones the tensors now, so callers may mutate them. ``copy=False`` writes
        them as they are: the caller must not modify them until :meth:`wait` says this version
        is durable (the follower's commit guarantees that, and so saves a copy of θ and the
        momentum on every outer step).
        """
        if copy:
            params = {n: t.clone() for n, t in params.items()}
            momenta = {n: t.clone() for n, t in momenta.items()}
        job = (version, params, momenta, checksum)
        with self._cond:
            self._job = job
            self._cond.notify_all()

    def wait(self, version: int, timeout_s: float) -> bool:
        """Block until a checkpoint of ``version`` (or newer) is complete; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._written >= version, timeout_s)

    @property
    def written(self) -> int:
        with self._cond:
            return self._written

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._job is not None or self._stop)
                if self._job is None:
                    return
                version, params, momenta, checksum = self._job
                self._job = None
            started = time.monotonic()
            try:
                save_checkpoint(self.root, version, self.index, params, momenta, checksum, self.keep)
            except OSError:
                log.exception("checkpoint of version %d failed", version)
                continue
            with self._cond:
                self._written = max(self._written, version)
                self._cond.notify_all()
            if self._on_saved is not None:
                try:
                    self._on_saved(version, time.monotonic() - started)
                except Exception:
                    log.exception("the checkpoint observer failed")

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the pending write (if any) and stop the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
