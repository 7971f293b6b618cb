"""A cluster's inner AdamW state and data position, saved at its own site (issue 14; §3, §12).

A restarted cluster pulls the global model again at its join, but its inner optimizer (§3:
AdamW, H steps between pushes) would start from zero: :class:`InnerStateStore` saves the
optimizer's state after every pull, when the local model is exactly one global version, and
loads it back before the next join. Layout, under the cluster's own ``--state-dir``::

    inner/current.json      the pointer: the payload directory in use and its metadata (JSON)
    inner/v<version>-<id>/   one payload: ``optimizer.safetensors`` (a process of its own, or
                            rank 0 of DDP replicas: the whole state) or a
                            torch.distributed.checkpoint directory (FSDP2: every rank writes
                            its own shards; pipeline: every stage rank the state of its own
                            stage's parameters, a tied matrix held by two stages once; all
                            ranks must see the same directory)

A save writes the payload into a temporary directory (files fsynced), renames it into place,
then replaces ``current.json`` atomically (write a temporary file, fsync, rename, fsync the
directory), and only then removes older payloads: a crash at any point leaves the previous
checkpoint whole. Nothing is pickled by dips (safetensors tensors, JSON metadata; DCP's own
``.metadata`` is torch's).

A load refuses, with :class:`InnerStateError` naming the file and the field, a pointer or
payload that is not intact (JSON, sizes, SHA-256 of every file) or that belongs to another
cluster id, another parallel layout (safetensors or DCP; among DCP layouts, FSDP2 or
pipeline), or a model whose parameter names or shapes differ; it
then changes nothing (neither the optimizer nor the files). The operator removes
``<state-dir>/inner`` to start the inner optimizer afresh. The optimizer's hyperparameters
(lr, betas, weight decay) stay the run config's; only the per-parameter state is loaded.

The data position saved with it (the leased chunks and window positions after the pull) is
the ledger's accepted position of that version: a hint only. The leader's ledger
(:mod:`dips.algo.ledger`) stays the source of truth: at the re-join the cluster trains from
the positions the leader leases it (:class:`dips.train.lease.LeaseSampler`), never from the
hint, so it neither replays nor skips windows the ledger did not assign it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Literal

import torch

from dips.roles.cluster_state_io import (
    FORMAT,
    POINTER,
    SAFETENSORS,
    InnerStateError,
    check_files,
    read_pointer,
    read_safetensors,
    sha256_of,
    param_table,
    read_saved,
    state_digest,
)
from dips.roles.durable import fsync_path, write_atomic
from dips.roles.rank_comm import Ranks, broadcast_params

__all__ = ["InnerStateError", "InnerStateStore", "read_saved", "state_digest"]

Mode = Literal["one", "ddp", "fsdp2", "pipeline"]
#: Modes whose ranks each save and load their own part through torch.distributed.checkpoint.
DCP_MODES = ("fsdp2", "pipeline")


class InnerStateStore:
    """Saves and loads one cluster's inner optimizer state (module docstring).

    Args:
        root: ``<state-dir>/inner`` (created at the first save).
        cluster_id: this cluster (checked at load).
        model: the cluster's model (the plain module: not the DDP wrapper; FSDP2: the
            ``fully_shard``-ed module); optimizer: its inner AdamW.
        mode: "one" (a process of its own), "ddp" (replicas: rank 0 saves the whole state,
            at load it reads it and broadcasts it to the others), "fsdp2" (sharded: every
            rank saves and loads its shards through torch.distributed.checkpoint) or
            "pipeline" (pipeline stages: ``optimizer`` holds this stage's parameters of the
            whole ``model``; every stage rank saves and loads its own through
            torch.distributed.checkpoint, by parameter name, so a restart with another
            split of the stages still finds each parameter's state).
        ranks: this rank's :class:`~dips.roles.rank_comm.Ranks` (all modes but "one").

    Save and load are collectives in the multi-rank modes: every rank calls them at the same
    point. Raises ValueError for a mode without its ranks.
    """

    def __init__(self, root: Path, cluster_id: str, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, mode: Mode = "one",
                 ranks: Ranks | None = None) -> None:
        if mode not in ("one", "ddp", *DCP_MODES) or (mode != "one") != (ranks is not None):
            raise ValueError(f"inner state: mode = {mode!r} with ranks = {ranks!r}")
        self.root, self.cluster_id, self.mode, self.ranks = Path(root), cluster_id, mode, ranks
        self.model, self.optimizer = model, optimizer
        self.lead = ranks is None or ranks.lead
        self.storage = "dcp" if mode in DCP_MODES else "safetensors"
        self.params = param_table(model)
        name_of = {id(p): n for n, p in model.named_parameters()}
        self.names = [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]
        token = f"{time.time_ns():x}"
        if ranks is not None:  # one payload name on every rank (DCP writes one folder)
            token = ranks.broadcast({"token": token} if ranks.lead else None)["token"]
        self._token, self._saves = token, 0
        self._read: dict[str, dict[str, torch.Tensor]] = {}  # checked by the lead, not loaded

    # ----- the live state ---------------------------------------------------------------
    def states(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer's state now: name -> {key: tensor} (DTensors under FSDP2)."""
        by_id = {id(p): n for n, p in self.model.named_parameters()}
        return {by_id[id(p)]: dict(s) for p, s in self.optimizer.state.items()}

    def step(self) -> float | None:
        """The AdamW step count of the first parameter with state (None: no state yet)."""
        for s in self.optimizer.state.values():
            if "step" in s:
                return float(s["step"])
        return None

    def digest(self) -> dict[str, Any]:
        """:func:`state_digest` of the live state (a collective under FSDP2)."""
        return state_digest(self.states())

    def digests(self) -> list[dict[str, Any]]:
        """Every rank's :meth:`digest`, in rank order (DDP: all-gathered, so that a replica
        that resumed another state shows; pipeline: each stage's own; FSDP2: the one state,
        gathered whole)."""
        mine = self.digest()
        if self.mode in ("ddp", "pipeline") and self.ranks:
            return self.ranks.gather(mine)
        return [mine]

    # ----- save -------------------------------------------------------------------------
    def save(self, version: int, data: dict[str, Any], counters: dict[str, int]) -> Path | None:
        """Save the state, ``data`` (the data position, JSON) and ``counters`` as the state
        of global ``version``; returns the payload directory (None on ranks that write
        nothing, or when the optimizer has no state yet). Raises OSError (disk) or what
        torch.distributed.checkpoint raises; the previous checkpoint stays whole."""
        if not self.optimizer.state:
            return None
        self._saves += 1
        name = f"v{version:08d}-{self._token}-{self._saves}"
        tmp = self.root / f".tmp-{name}"
        failed: OSError | None = None
        if self.lead:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            except OSError as exc:
                failed = exc
        if self.storage == "dcp":  # every rank writes into the lead's folder, or none does
            assert self.ranks is not None
            if self.ranks.any(failed is not None):
                raise failed or OSError(f"inner state: rank 0 could not make {tmp}")
        elif failed is not None:
            raise failed
        if self.storage == "dcp":
            self._save_dcp(tmp)
        elif self.lead:
            self._save_safetensors(tmp / SAFETENSORS)
        if not self.lead:
            return None
        files = {f.name: {"bytes": f.stat().st_size, "sha256": sha256_of(f)}
                 for f in sorted(tmp.iterdir()) if f.is_file()}
        fsync_path(tmp)
        final = self.root / name
        os.rename(tmp, final)
        fsync_path(self.root)
        meta = {"format": FORMAT, "cluster_id": self.cluster_id, "version": int(version),
                "mode": self.mode, "storage": self.storage,
                "world": self.ranks.world if self.ranks else 1, "payload": name, "files": files,
                "params": self.params, "data": data, "counters": counters,
                "step": self.step(),
                "saved_at": round(time.time(), 3)}
        write_atomic(self.root / POINTER, json.dumps(meta, indent=1).encode())
        for old in self.root.iterdir():
            if old.is_dir() and old.name != name:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def _save_safetensors(self, path: Path) -> None:
        from safetensors.torch import save

        sd = self.optimizer.state_dict()
        flat = {f"{self.names[i]}::{k}": v.detach().cpu().contiguous()
                for i, s in sd["state"].items() for k, v in s.items() if torch.is_tensor(v)}
        with open(path, "wb") as f:
            f.write(save(flat))
            f.flush()
            os.fsync(f.fileno())

    def _save_dcp(self, tmp: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        osd = get_optimizer_state_dict(self.model, self.optimizer)
        # Tensors only: the hyperparameters are the run config's (nothing to pickle).
        dcp.save({"optimizer": {"state": osd["state"]}},
                 storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True))

    # ----- load -------------------------------------------------------------------------
    def load(self) -> dict[str, Any] | None:
        """Load the saved state into the optimizer (before the join); returns the saved
        metadata (version, data, counters, step), or None when nothing is saved.

        Raises InnerStateError (on every rank) if the checkpoint is not intact or not this
        cluster's or this model's; the optimizer and the files are then left as they were.
        """
        meta, error = None, None
        if self.lead or self.storage == "dcp":
            try:
                meta = read_pointer(self.root)
                if meta is not None:
                    self._check(meta)
            except InnerStateError as exc:  # told to every rank, below
                error = str(exc)
            except OSError as exc:
                error = f"inner state {self.root}: not readable ({exc})"
        if self.mode == "ddp":
            assert self.ranks is not None
            msg = self.ranks.broadcast({"meta": meta, "error": error} if self.lead else None)
            meta, error = msg["meta"], msg["error"]
        elif self.storage == "dcp":
            assert self.ranks is not None
            if self.ranks.any(error is not None):
                raise InnerStateError(error or "inner state: refused on another rank")
        if error is not None:
            raise InnerStateError(error)
        if meta is None:
            return None
        if self.storage == "dcp":
            self._load_dcp(self.root / meta["payload"])
        else:
            self._load_whole()
        return meta

    def _check(self, meta: dict[str, Any]) -> None:
        where = self.root / POINTER
        if meta.get("cluster_id") != self.cluster_id:
            raise InnerStateError(f"inner state {where}: field 'cluster_id' = "
                                  f"{meta.get('cluster_id')!r}, this cluster is "
                                  f"{self.cluster_id!r}")
        if meta.get("storage") != self.storage or (self.storage == "dcp"
                                                   and meta.get("mode") != self.mode):
            raise InnerStateError(f"inner state {where}: field 'mode' = {meta.get('mode')!r} "
                                  f"({meta.get('storage')}), this cluster runs {self.mode!r}")
        saved = meta.get("params")
        if saved != self.params:
            saved = saved if isinstance(saved, dict) else {}
            diff = sorted(set(saved) ^ set(self.params)) or sorted(
                n for n in self.params if saved.get(n) != self.params[n])
            n = diff[0] if diff else "?"
            raise InnerStateError(f"inner state {where}: field 'params' differs from this "
                                  f"model at {n!r}: saved {saved.get(n)}, model "
                                  f"{self.params.get(n)}")
        payload = check_files(self.root, meta)
        if self.storage == "safetensors":
            states = read_safetensors(payload / SAFETENSORS)
            for name, s in states.items():
                for key, t in s.items():
                    if key.startswith("exp_avg") and list(t.shape) != self.params.get(name):
                        raise InnerStateError(f"inner state {payload / SAFETENSORS}: "
                                              f"{name}::{key} has shape {list(t.shape)}, "
                                              f"the parameter {self.params.get(name)}")
            self._read = states

    def _load_whole(self) -> None:
        """Modes one and ddp: the lead's checked file into every rank's optimizer."""
        states = self._read if self.lead else {}
        if self.mode == "ddp":
            assert self.ranks is not None
            shapes = self.ranks.broadcast(
                {"s": {n: {k: [str(t.dtype), list(t.shape)] for k, t in s.items()}
                       for n, s in states.items()}} if self.lead else None)["s"]
            if not self.lead:
                states = {n: {k: torch.empty(shape, dtype=getattr(torch, d.split(".")[-1]))
                              for k, (d, shape) in s.items()} for n, s in shapes.items()}
            order = [(n, k) for n in sorted(states) for k in sorted(states[n])]
            moved = [states[n][k].to(self.ranks.device) for n, k in order]
            broadcast_params(moved, 0)
            for (n, k), t in zip(order, moved):
                states[n][k] = t.cpu() if k == "step" else t  # where AdamW keeps it
        index = {n: i for i, n in enumerate(self.names)}
        sd = self.optimizer.state_dict()
        sd["state"] = {index[n]: s for n, s in states.items() if n in index}
        self.optimizer.load_state_dict(sd)
        self._read = {}

    def _load_dcp(self, payload: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        hyper = [{k: v for k, v in g.items() if k != "params"}
                 for g in self.optimizer.param_groups]
        osd = get_optimizer_state_dict(self.model, self.optimizer)  # a zero state to fill
        dcp.load({"optimizer": {"state": osd["state"]}},
                 storage_reader=dcp.FileSystemReader(str(payload)))
        set_optimizer_state_dict(self.model, self.optimizer, osd)
        for g, h in zip(self.optimizer.param_groups, hyper):
            g.update(h)  # the run config's hyperparameters, not the saved ones
