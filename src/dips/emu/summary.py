"""End of a run: export the global model, evaluate it, and write ``summary.json``.

``summary.json`` fields (units): ``method``, ``clusters``, ``followers``, ``H``,
``outer_steps`` (versions applied), ``rounds``, ``tokens_consumed`` (tokens of every inner
step of every cluster, over every process it ran as, at least what the leader saw it push),
``tokens_accepted`` (T_j of accepted
pushes, the ledger's count), ``per_cluster`` (each cluster's ``updates_pushed``,
``updates_accepted``, ``updates_rejected``, ``updates_lost``, ``tokens_pushed``,
``tokens_accepted`` from the leader's ``outer_steps.jsonl``, over every process of the
cluster and of the leader, less the steps rolled back; and its ``tokens_consumed``),
``updates_pushed``, ``updates_accepted``, ``updates_rejected``
(every push not accepted, whatever the reason: penalty, invalid, a failed round; each
decision line of ``outer_steps.jsonl`` says why), ``outer_steps_lost`` (steps rolled back by
reconciliation), ``eval_loss_initial`` / ``eval_loss_final`` (nats/token on the
held-out split, full precision: only displays round them), ``wall_time_s`` (launch to
summary), ``train_time_s`` (training start to the stop: training only), ``shutdown_s`` (the
stop to the clusters stopped and the last round done), ``final_eval_s`` (the final
evaluation and export), ``tokens_per_s`` (tokens_consumed / train_time_s), ``final_version``,
``interrupted``, ``model_dir``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import torch

from dips.algo.consumed import tokens_consumed_of, trained_at_least
from dips.algo.pushcounts import PER_CLUSTER, leader_counts
from dips.spec import RunConfig, RunSpec
from dips.wire.keys import MemberKey


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSON-lines file; a torn last line (killed writer) is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def tokens_consumed(run_dir: Path, cfg: RunConfig) -> dict[str, int]:
    """Per cluster: tokens of all its inner steps, over every process it ran as, from its
    ``train.jsonl`` (:func:`dips.algo.consumed.tokens_consumed_of`: a restarted process
    counts from 0 again, a resumed one on from the saved count, which an earlier process
    trained and counted; ``dips report`` counts with the same rule)."""
    return {c.id: tokens_consumed_of(read_jsonl(run_dir / "clusters" / c.id / "train.jsonl"))
            for c in cfg.clusters}


def per_cluster(run_dir: Path, cfg: RunConfig) -> dict[str, dict[str, int]]:
    """Each configured cluster's :func:`dips.algo.pushcounts.leader_counts` (zeros if it
    never pushed; one rule with ``dips report``) with its
    ``tokens_consumed``: :func:`tokens_consumed`, but never below the leader's
    ``tokens_pushed`` (every token a push carried was trained; a process killed after its
    push was decided and before its line was written leaves ``train.jsonl`` short)."""
    counts = leader_counts(read_jsonl(run_dir / "outer_steps.jsonl"))
    consumed = tokens_consumed(run_dir, cfg)
    out = {}
    for c in cfg.clusters:
        row = counts.get(c.id, dict.fromkeys(PER_CLUSTER, 0))
        out[c.id] = {**row, "tokens_consumed": trained_at_least(consumed[c.id],
                                                                row["tokens_pushed"])}
    return out


class HeldOut:
    """The model and the held-out split one process evaluates with, loaded once (``dips
    export``, ``dips evaluate``, the launcher's final export: one evaluation routine,
    :func:`dips.train.loop.eval_loss` with the run's ``eval_batch_size`` × ``eval_batches``).

    Args:
        cfg: the run config. cache: the tokenizer/token cache (built from the bundled
            corpora there if missing). spec: the run spec, when given this host's copy of
            the data is checked against it (:func:`dips.train.datasource.check_run_data`:
            ValueError if it differs).
    """

    def __init__(self, cfg: RunConfig, cache: Path, spec: RunSpec | None = None) -> None:
        from transformers.utils import logging as hf_logging

        from dips.train.datasource import load_data
        from dips.train.model import build_model

        hf_logging.disable_progress_bar()
        self.cfg, self.cache = cfg, cache
        data = load_data(cfg.data, cache)
        if spec is not None:
            from dips.train.datasource import check_run_data

            check_run_data(data, spec.train_tokens, spec.data_digest, "the evaluator")
        self.val = data.val
        self.model = build_model(cfg.model, cfg.seed)

    @property
    def eval_tokens(self) -> int:
        """Tokens one evaluation predicts (windows × seq_len)."""
        from dips.train.loop import eval_windows

        cfg = self.cfg
        n = len(eval_windows(self.val.size, cfg.inner.seq_len,
                             cfg.eval_batch_size * cfg.eval_batches))
        return n * cfg.inner.seq_len

    def pull_and_evaluate(self, source: Callable[[], tuple[list[Any], int]], key: MemberKey,
                          attempts: int = 1) -> tuple[float | None, int | None, str | None]:
        """Pull the global model in FP32 with the observer ``key`` and evaluate it.

        ``source()`` gives the followers (``pb.FollowerInfo``: index, layers, data endpoint)
        and the version to pull; it is asked again before each of ``attempts`` tries, so a run
        that moved on meanwhile (its followers serve only their current version) is pulled at
        its new version. Returns ``(eval loss in nats/token, version, None)``, or ``(None,
        None, error)`` when every try failed (each pull waits at most ``timeouts.rpc_s``)."""
        from dips.roles.cluster import fetch_global_model
        from dips.train.loop import eval_loss

        cfg = self.cfg
        error = "no attempt"
        for _ in range(max(1, attempts)):
            followers, version = source()
            try:
                fetch_global_model(self.model, followers, version, key,
                                   timeout_s=cfg.timeouts.rpc_s)
            except (RuntimeError, ValueError, TimeoutError) as exc:
                error = f"{type(exc).__name__}: {exc}"
                continue
            loss = eval_loss(self.model, self.val, cfg.inner.seq_len, cfg.eval_batch_size,
                             cfg.eval_batches)
            return loss, version, None
        return None, None, error


def export_model(cfg: RunConfig, cache: Path, source: Callable[[], tuple[list[Any], int]],
                 key: MemberKey, out_dir: Path, attempts: int = 1) -> tuple[float | None, str | None]:
    """Pull the global model in FP32 with the observer ``key``, evaluate it on the held-out
    split (nats/token) and save it to ``out_dir`` (HF safetensors + config + tokenizer).

    ``source`` and ``attempts``: see :meth:`HeldOut.pull_and_evaluate`. Returns ``(eval
    loss, None)``, or ``(None, error)`` when every try failed (nothing is written then). The
    tokenizer and data come from ``cache`` (built from the bundled corpora there if missing),
    before the first pull."""
    from dips.train.datasource import save_tokenizer

    held = HeldOut(cfg, cache)
    loss, _, error = held.pull_and_evaluate(source, key, attempts)
    if loss is None:
        return None, error
    held.model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(cfg.data, cache, out_dir)
    return loss, None


def export_and_summarize(cfg: RunConfig, run_dir: Path, spec: RunSpec, key: MemberKey | None,
                         status: Any, t_start: float, times: dict[str, float],
                         interrupted: bool) -> dict[str, Any]:
    """Pull the final FP32 model with the observer ``key`` (None: no model), save it (HF
    safetensors + tokenizer), evaluate, summarize. A pull that fails leaves
    ``eval_loss_final`` null (the error is in ``export_error``); the summary is written.

    ``times`` (seconds): ``train_time_s`` (the training start to the stop: the leader ended
    the run, a limit, or Ctrl-C), ``shutdown_s`` (the stop to the clusters stopped and the
    last round done), ``final_eval_s`` (the evaluator's final evaluation so far; the export's
    pull and held-out evaluation here are added to it). ``t_start``: ``time.time()`` of the
    launch (``wall_time_s`` counts from it)."""
    t_export = time.monotonic()
    cache = (spec.cache_dir or cfg.data.cache_dir).resolve()
    final_loss = None
    model_dir = run_dir / "final"
    version = status.version if status is not None else 0
    export_error = None
    if status is not None and key is not None:
        from dips.wire.pb import control_pb2 as pb

        # Through each follower's ipc endpoint: reachable from outside its network namespace.
        local = [pb.FollowerInfo(index=f.index, layers=list(f.layers),
                                 data_endpoint=f"ipc://{run_dir / f'follower-{f.index}.ipc'}")
                 for f in status.followers]
        final_loss, export_error = export_model(cfg, cache, lambda: (local, version), key,
                                                model_dir)
    final_eval_s = times.get("final_eval_s", 0.0) + time.monotonic() - t_export
    train_s = times.get("train_time_s", 0.0)
    clusters = per_cluster(run_dir, cfg)
    consumed = {cid: row["tokens_consumed"] for cid, row in clusters.items()}
    total = sum(consumed.values())
    summary = {
        "method": "di-ps", "run_dir": str(run_dir), "clusters": len(cfg.clusters),
        "cluster_ids": [c.id for c in cfg.clusters],
        "slowdowns": [c.slowdown for c in cfg.clusters], "followers": cfg.followers,
        "H": cfg.inner.H, "params": spec.params,
        "outer_steps": status.outer_steps if status else 0,
        "rounds": status.rounds if status else 0,
        "final_version": version,
        "tokens_consumed": total, "tokens_consumed_per_cluster": consumed,
        "per_cluster": clusters,
        "tokens_accepted": status.tokens_accepted if status else 0,
        "updates_pushed": status.updates_pushed if status else 0,
        "updates_accepted": status.updates_accepted if status else 0,
        "updates_rejected": status.updates_rejected if status else 0,
        "outer_steps_lost": status.outer_steps_lost if status else 0,
        "eval_loss_initial": spec.eval_loss_initial, "eval_loss_final": final_loss,
        "wall_time_s": round(time.time() - t_start, 2), "train_time_s": round(train_s, 2),
        "shutdown_s": round(times.get("shutdown_s", 0.0), 2),
        "final_eval_s": round(final_eval_s, 2),
        "tokens_per_s": round(total / train_s, 1) if train_s > 0 else 0.0,
        "interrupted": interrupted, "export_error": export_error, "model_dir": str(model_dir) if final_loss is not None else None,
        "torch_threads": torch.get_num_threads(),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
