"""What every virtual-time method shares: data, clusters with real models, evaluation (§12, §13).

Each method of a comparison builds one :class:`World` from the scenario: the same tokenizer and
token stream (:func:`dips.train.corpus.load_tokens`), the same data chunks per cluster
(:func:`dips.train.sampler.assign_chunks`, disjoint), the same seeded model
(:func:`dips.train.model.build_model`) and one fused AdamW per cluster
(:func:`dips.train.loop.make_inner_optimizer`): one
:class:`~dips.train.trainer.ClusterTrainer` per cluster, built by
:func:`dips.train.trainer.build_trainer` as in the real-time processes.  Inner steps are the
trainer's real steps; only their *duration* is emulated (:mod:`dips.emu.vclock`).
Evaluations use :func:`dips.train.loop.eval_loss` on the held-out split every
``eval_every_tokens`` tokens.  Everything runs on one thread (``torch.set_num_threads(1)``) in
a fixed order, so two runs of the same scenario give the same numbers bit for bit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from dips.emu.result import CurvePoint, MethodResult
from dips.emu.vclock import step_duration
from dips.spec import ClusterConfig, Scenario
from dips.train.datasource import load_data
from dips.train.loop import eval_loss
from dips.train.model import build_model, check_built, param_count
from dips.train.sampler import BatchSampler
from dips.train.trainer import ClusterTrainer, build_trainer
from dips.wire.frames import DTYPES

__all__ = ["PROGRESS", "VCluster", "World", "bf16_copy", "load_params", "wire_copy"]

#: Optional hook called after every evaluation with (tokens, token budget, loss); the CLI
#: sets it to drive its progress bar.
PROGRESS: Callable[[int, int, float], None] | None = None


def bf16_copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters as BF16 copies (what crosses a link, §12), by parameter name."""
    return wire_copy(model, "bf16")


def wire_copy(model: torch.nn.Module, dtype: str) -> dict[str, torch.Tensor]:
    """The model's parameters as copies in the wire dtype ``dtype`` ("bf16", §12, or "fp32";
    ``OuterConfig.wire_dtype``), by parameter name."""
    return {n: p.detach().to(DTYPES[dtype], copy=True) for n, p in model.named_parameters()}


@torch.no_grad()
def load_params(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Overwrite ``model``'s parameters in place from ``params`` (any float dtype, same names)."""
    for n, p in model.named_parameters():
        p.copy_(params[n])


@dataclass
class VCluster:
    """One emulated cluster: its spec, its trainer (real model, inner AdamW, sampler) and counters.

    Counters: ``tokens`` consumed (tokens) and ``steps`` inner steps (the trainer's),
    ``tokens_since_sync`` (tokens since its last pull), ``comm_s`` seconds spent on its own
    outer transfers, ``idle_s`` seconds not computing (waiting + transfers).
    """

    spec: ClusterConfig
    trainer: ClusterTrainer
    tokens_since_sync: int = 0
    comm_s: float = 0.0
    idle_s: float = 0.0
    last_loss: float = float("nan")
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> torch.nn.Module:
        """The cluster's model (FP32)."""
        return self.trainer.model

    @property
    def opt(self) -> torch.optim.Optimizer:
        """The cluster's inner AdamW."""
        return self.trainer.optimizer

    @property
    def sampler(self) -> BatchSampler:
        """The cluster's batches (its fixed share of the chunks)."""
        return self.trainer.batches  # type: ignore[return-value]

    @property
    def tokens(self) -> int:
        """Tokens trained on so far (tokens)."""
        return self.trainer.tokens

    @property
    def steps(self) -> int:
        """Inner steps (batches) trained on so far."""
        return self.trainer.steps

    def step(self) -> float:
        """Run one real inner step; count its tokens. Returns the training loss (nats/token)."""
        result = self.trainer.step()
        self.last_loss = result.loss
        self.tokens_since_sync += result.tokens
        return result.loss


class World:
    """Data, clusters and evaluation of one method's virtual-time run.

    Args:
        scenario: the comparison scenario.
        out_dir: where ``events.jsonl`` (one line per outer event) is written.
        method: the method name (for the result).
        replicas: build one model + AdamW per cluster (False: only cluster 0's, for DP whose
            replicas are identical by construction).
    """

    def __init__(self, scenario: Scenario, out_dir: Path, method: str, replicas: bool = True) -> None:
        torch.set_num_threads(1)
        self.scenario = s = scenario
        self.method = method
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.out_dir / "events.jsonl", "w")
        data = load_data(s.data)
        self.val = data.val
        ids = [c.id for c in s.clusters]
        self.clusters: list[VCluster] = []
        first: ClusterTrainer | None = None
        for spec in s.clusters:
            trainer = build_trainer(spec.id, s.model, s.data, s.inner, s.seed, assignment=ids,
                                    tokens=data, share=None if replicas else first)
            first = first or trainer
            self.clusters.append(VCluster(spec, trainer))
        self.eval_model = build_model(s.model, s.seed)
        self.names = [n for n, _ in self.eval_model.named_parameters()]
        self.table = check_built(self.eval_model, s.inner.seq_len, s.followers,
                                 s.model.layer_pattern)
        self.params = param_count(self.eval_model)
        self.transfer_bytes = s.transfer_bytes(self.params)
        #: bytes of one transfer in the run's wire dtype (transfer_bytes is the BF16 size, §12)
        self.wire_bytes = self.transfer_bytes * DTYPES[s.outer.wire_dtype].itemsize / 2
        self.tokens_per_step = s.inner.batch_size * s.inner.seq_len
        self.curve: list[CurvePoint] = []
        self._next_eval = 0

    # ----- progress -----------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        """Tokens consumed by all clusters so far."""
        return sum(c.tokens for c in self.clusters)

    @property
    def done(self) -> bool:
        """True once the token budget is consumed."""
        return self.tokens >= self.scenario.token_budget

    def step_s(self, c: VCluster, t: float) -> float:
        """Emulated duration (s) of ``c``'s next inner step started at virtual time ``t``."""
        return step_duration(c.spec, t, self.scenario.timing.step_s)

    def evaluate(self, params: dict[str, torch.Tensor] | torch.nn.Module) -> float:
        """Validation loss (nats/token) of ``params`` (a model or a name -> tensor dict)."""
        s = self.scenario
        if isinstance(params, torch.nn.Module):
            model = params
        else:
            load_params(self.eval_model, params)
            model = self.eval_model
        return eval_loss(model, self.val, s.inner.seq_len, s.eval_batch_size, s.eval_batches)

    def maybe_eval(self, t: float, params: Callable[[], dict[str, torch.Tensor] | torch.nn.Module],
                   force: bool = False) -> None:
        """Evaluate when the consumed tokens crossed the next ``eval_every_tokens`` mark."""
        tokens = self.tokens
        if force or tokens >= self._next_eval:
            loss = self.evaluate(params())
            self.curve.append(CurvePoint(round(t, 6), tokens, loss))
            if PROGRESS is not None:
                PROGRESS(tokens, self.scenario.token_budget, loss)
            every = self.scenario.eval_every_tokens
            self._next_eval = (tokens // every + 1) * every

    def log(self, **record: Any) -> None:
        """Append one JSON line to ``events.jsonl``."""
        self._log.write(json.dumps(record) + "\n")

    # ----- result ---------------------------------------------------------------------------
    def result(self, time_s: float, tokens_accepted: int, pushed: int, accepted: int,
               rejected: int, final: dict[str, torch.Tensor] | torch.nn.Module,
               extra: dict[str, Any] | None = None) -> MethodResult:
        """Evaluate the final model and assemble the :class:`MethodResult` (closes the log)."""
        point = CurvePoint(round(time_s, 6), self.tokens, self.evaluate(final))
        if self.curve and self.curve[-1].tokens == point.tokens:
            self.curve[-1] = point
        else:
            self.curve.append(point)
        self._log.close()
        per_cluster = {c.spec.id: {"tokens": c.tokens, "steps": c.steps,
                                   "comm_s": round(c.comm_s, 3), "idle_s": round(c.idle_s, 3),
                                   "idle_frac": round(c.idle_s / time_s, 4) if time_s else 0.0,
                                   **c.extra} for c in self.clusters}
        ex = {"clusters": per_cluster, "param_count": self.params,
              "transfer_bytes": self.transfer_bytes,
              "transfer_over_round_10gbit": self.scenario.transfer_over_round(self.params)}
        ex.update(extra or {})
        tokens = self.tokens
        return MethodResult(
            method=self.method, mode="virtual", time_s=time_s, tokens=tokens,
            tokens_accepted=tokens_accepted, comm_s=sum(c.comm_s for c in self.clusters),
            updates_pushed=pushed, updates_accepted=accepted, updates_rejected=rejected,
            final_eval_loss=self.curve[-1].eval_loss,
            tokens_per_s=tokens / time_s if time_s > 0 else 0.0, curve=list(self.curve),
            shaping="virtual", extra=ex)
