"""Turn a real-time baseline run's logs and snapshots into a :class:`MethodResult` (§15, §18).

Reads ``clusters/<id>/train.jsonl`` (one line per inner step; sync lines carry ``sync: true``
with ``comm_s`` and, for the barrier methods, ``wait_s``), ``snapshots/<id>/snapshots.jsonl``
(models saved during the run) and evaluates the snapshots on the held-out split after every
process has exited, so evaluation never competes with training for the CPU.

Definitions (seconds are real, since the common start ``t0``):

* ``time_s``: data parallel and synchronous DiLoCo: end of the last outer sync; asynchronous
  DiLoCo: the moment the clusters' summed tokens reached the budget (last step if never).
* ``tokens``: tokens of every inner step run; ``tokens_accepted``: those that entered a global
  model (every step for data parallel; steps before each cluster's last outer sync otherwise).
* ``comm_s``: summed over clusters, time in the all-reduces (after the barrier) or, for the
  asynchronous method, from the first send to the last peer's acknowledgement; ``extra
  ["wait_s"]`` is the barrier time (waiting for slower clusters).
* curve and ``final_eval_loss``: cluster 0's model (identical replicas for the synchronous
  methods; its own replica for the asynchronous one, whose other replicas are in ``extra``).
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

from dips.spec import WorkerSpec
from dips.emu.result import CurvePoint, MethodResult
from dips.emu.summary import read_jsonl

__all__ = ["collect", "read_jsonl"]


class _Evaluator:
    """Evaluates saved parameter files with the run's model, validation split and windows."""

    def __init__(self, spec: WorkerSpec) -> None:
        import torch

        from dips.train.datasource import load_data
        from dips.train.model import build_model

        d = spec.data
        self.val = load_data(d).val
        self.model = build_model(spec.model, spec.seed)
        self.spec = spec
        torch.set_num_threads(2)

    def __call__(self, path: Path | None = None) -> float:
        """Validation loss (nats/token) of the parameters in ``path`` (None: the initial model)."""
        import torch
        from safetensors.torch import load_file

        from dips.train.loop import eval_loss

        if path is not None:
            state = load_file(str(path))
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    p.copy_(state[name])
        s = self.spec
        return eval_loss(self.model, self.val, s.inner.seq_len, s.eval_batch_size, s.eval_batches)


def collect(spec: WorkerSpec, run_dir: Path, t0: float, shaping: str,
            extra: dict[str, Any] | None = None) -> MethodResult:
    """Build the run's :class:`MethodResult` (definitions in the module docstring)."""
    ids = [c.id for c in spec.clusters]
    logs = {cid: read_jsonl(run_dir / "clusters" / cid / "train.jsonl") for cid in ids}
    steps = {cid: [r for r in rs if "loss" in r] for cid, rs in logs.items()}
    syncs = {cid: [r for r in rs if r.get("sync")] for cid, rs in logs.items()}
    tokens_of = {cid: max((int(r.get("tokens", 0)) for r in rs), default=0) for cid, rs in logs.items()}
    tokens = sum(tokens_of.values())
    tpb = spec.inner.batch_size * spec.inner.seq_len
    timeline = sorted(float(r["time"]) for rs in steps.values() for r in rs)
    cumulative = [tpb * (i + 1) for i in range(len(timeline))]

    def tokens_at(t: float) -> int:
        return cumulative[bisect.bisect_right(timeline, t) - 1] if timeline and t >= timeline[0] else 0

    last_time = max((float(r["time"]) for rs in logs.values() for r in rs if "time" in r), default=0.0)
    if spec.method == "async-diloco":
        crossed = bisect.bisect_left(cumulative, spec.token_budget)
        time_s = timeline[crossed] if crossed < len(timeline) else (timeline[-1] if timeline else 0.0)
    else:
        time_s = max((float(rs[-1]["time"]) for rs in syncs.values() if rs), default=last_time)
    accepted = tokens if spec.method == "dp" else sum(
        int(rs[-1]["tokens"]) for rs in syncs.values() if rs)
    outer = 0 if spec.method == "dp" else sum(len(rs) for rs in syncs.values())
    comm_s = sum(float(r.get("comm_s", 0.0)) for rs in syncs.values() for r in rs)

    evaluate = _Evaluator(spec)
    curve = [CurvePoint(0.0, 0, evaluate())]
    snap_dir = run_dir / "snapshots" / ids[0]
    final_loss = curve[0].eval_loss
    for snap in sorted(read_jsonl(snap_dir / "snapshots.jsonl"), key=lambda r: r["time"]):
        loss = evaluate(snap_dir / snap["file"])
        t = float(snap["time"])
        toks = tokens_at(t) if spec.method == "async-diloco" else int(snap["tokens"])
        curve.append(CurvePoint(round(t, 4), toks, loss))
        if snap["file"] == "final.safetensors":
            final_loss = loss
    more: dict[str, Any] = dict(extra or {})
    if spec.method == "async-diloco":
        finals = {cid: evaluate(run_dir / "snapshots" / cid / "final.safetensors") for cid in ids
                  if (run_dir / "snapshots" / cid / "final.safetensors").exists()}
        more["final_eval_loss_per_cluster"] = finals
        applied = [r.get("applied", 1) for rs in syncs.values() for r in rs]
        more["mean_mixed"] = sum(applied) / len(applied) if applied else 0.0
        links = [r for rs in logs.values() for r in rs if r.get("event") == "links"]
        more["undelivered"] = sum(r.get("undelivered", 0) for r in links)
    else:
        more["wait_s"] = round(sum(float(r.get("wait_s", 0.0)) for rs in syncs.values() for r in rs), 4)
    ends = {cid: next((r for r in reversed(rs) if r.get("event") == "end"), {}) for cid, rs in logs.items()}
    losses0 = [float(r["loss"]) for r in steps[ids[0]]]
    k = max(1, min(5, len(losses0) // 4)) if losses0 else 1
    per: dict[str, dict[str, Any]] = {}
    for cid in ids:
        c_comm = sum(float(r.get("comm_s", 0.0)) for r in syncs[cid])
        c_wait = sum(float(r.get("wait_s", 0.0)) for r in syncs[cid])
        per[cid] = {"tokens": tokens_of[cid], "steps": len(steps[cid]), "comm_s": round(c_comm, 4),
                    "wait_s": round(c_wait, 4), "overruns": ends[cid].get("overruns"),
                    "idle_frac": (c_comm + c_wait) / time_s if time_s > 0 else 0.0}
    more.update({
        "clusters": per,
        "diverged": [cid for cid, rs in logs.items() if any(r.get("event") == "diverged" for r in rs)],
        "train_loss_first": sum(losses0[:k]) / k if losses0 else None,
        "train_loss_last": sum(losses0[-k:]) / k if losses0 else None,
        "step_s": spec.step_s, "payload_bytes": spec.payload_bytes,
        "rates_bps": {c.id: c.link.bps if c.link else None for c in spec.clusters},
        "last_record_s": round(last_time, 4),
    })
    return MethodResult(
        method=spec.method, mode="real", time_s=round(time_s, 4), tokens=tokens,
        tokens_accepted=accepted, comm_s=round(comm_s, 4), updates_pushed=outer,
        updates_accepted=outer, updates_rejected=0, final_eval_loss=final_loss,
        tokens_per_s=round(tokens / time_s, 2) if time_s > 0 else 0.0, curve=curve,
        shaping=shaping, extra=more)
