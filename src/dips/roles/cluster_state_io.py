"""The files of a cluster's saved inner state (issue 14): layout, integrity, reading.

See :mod:`dips.roles.cluster_state` for the layout under ``<state-dir>/inner`` and the
rules; this module writes files durably (temporary file, fsync, rename, fsync the folder),
checks a checkpoint's files against the SHA-256 and sizes its pointer lists, reads a
payload back (safetensors, or a torch.distributed.checkpoint directory without a process
group) and digests an AdamW state for comparisons.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["FORMAT", "POINTER", "SAFETENSORS", "InnerStateError", "check_files",
           "param_table", "read_pointer", "read_safetensors", "read_saved", "sha256_of",
           "state_digest"]


#: Version of the layout above (``format`` in current.json).
FORMAT = 1
POINTER = "current.json"
SAFETENSORS = "optimizer.safetensors"



class InnerStateError(ValueError):
    """A saved inner state that cannot be resumed (corrupt, another cluster's, another model)."""


def param_table(model: torch.nn.Module) -> dict[str, list[int]]:
    """Parameter name -> global shape (a DTensor's ``shape`` is the unsharded one)."""
    return {n: list(p.shape) for n, p in model.named_parameters()}


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A host FP32 copy of ``t`` (a DTensor gathered whole first: a collective)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()  # type: ignore[attr-defined]
    return t.detach().float().cpu().contiguous()


def state_digest(states: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """``{"step", "exp_avg", "exp_avg_sq"}`` of an AdamW state (name -> {key: tensor}): the
    step of the first parameter (float; AdamW steps every parameter alike) and the SHA-256
    (hex) of each moment over all parameters in name order (FP32 bytes). DTensors are
    gathered whole (every rank must call it)."""
    out: dict[str, Any] = {"step": None}
    for key in ("exp_avg", "exp_avg_sq"):
        h = hashlib.sha256()
        for name in sorted(states):
            if key in states[name]:
                h.update(name.encode())
                h.update(_whole(states[name][key]).numpy().tobytes())
        out[key] = h.hexdigest()
    for name in sorted(states):
        if "step" in states[name]:
            out["step"] = float(_whole(states[name]["step"]))
            break
    return out


def sha256_of(path: Path) -> str:
    """The SHA-256 (hex) of the file at ``path``, read in 1 MiB blocks. Raises OSError."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_pointer(root: Path) -> dict[str, Any] | None:
    """``root/current.json`` (None if absent). Raises InnerStateError if unreadable."""
    pointer = root / POINTER
    if not pointer.exists():
        return None
    try:
        meta = json.loads(pointer.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InnerStateError(f"inner state {pointer}: not readable JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise InnerStateError(f"inner state {pointer}: field 'format' = "
                              f"{meta.get('format') if isinstance(meta, dict) else meta!r}, "
                              f"expected {FORMAT}")
    return meta


def check_files(root: Path, meta: dict[str, Any]) -> Path:
    """The payload directory, once every listed file has its size and SHA-256."""
    payload = root / str(meta.get("payload", ""))
    files = meta.get("files")
    if not meta.get("payload") or not isinstance(files, dict) or not files:
        raise InnerStateError(f"inner state {root / POINTER}: no field 'payload'/'files'")
    for name, want in files.items():
        path = payload / name
        if not path.is_file():
            raise InnerStateError(f"inner state {path}: missing")
        if path.stat().st_size != want.get("bytes") or sha256_of(path) != want.get("sha256"):
            raise InnerStateError(f"inner state {path}: corrupt (size or SHA-256 differs "
                                  "from current.json)")
    return payload


def read_saved(root: Path) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """The metadata and the optimizer state (name -> {key: host tensor}) saved under
    ``root`` (``<state-dir>/inner``), after checking every file. For inspection and tests;
    a DCP payload is read without a process group. Raises InnerStateError (nothing saved,
    or corrupt)."""
    meta = read_pointer(root)
    if meta is None:
        raise InnerStateError(f"inner state {root / POINTER}: nothing saved")
    payload = check_files(root, meta)
    if meta["storage"] == "safetensors":
        return meta, read_safetensors(payload / SAFETENSORS)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(payload))
    md = reader.read_metadata()
    template = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
                for k, v in md.state_dict_metadata.items()
                if isinstance(v, TensorStorageMetadata) and k.startswith("optimizer.state.")}
    with warnings.catch_warnings():  # "no process group: loading in one process" is the point
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(template, storage_reader=reader, no_dist=True)
    states: dict[str, dict[str, torch.Tensor]] = {}
    for flat, t in template.items():
        path = md.planner_data[flat]  # ("optimizer", "state", fqn, key)
        states.setdefault(str(path[2]), {})[str(path[3])] = t
    return meta, states


def read_safetensors(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """An optimizer state saved as safetensors (keys ``<param name>::<state key>``): name ->
    {key: host tensor}. Raises InnerStateError naming the file if it is not readable."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        flat = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise InnerStateError(f"inner state {path}: not a safetensors file ({exc})") from None
    states: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        name, _, field = key.rpartition("::")
        states.setdefault(name, {})[field] = t
    return states
