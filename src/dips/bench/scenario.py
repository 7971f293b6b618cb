"""Comparison scenarios for ``dips bench compare`` (seed §4, §13–§15: heterogeneous clusters).

A scenario fixes everything the compared methods share — model, tokenizer/data chunks, inner
AdamW, outer Nesterov defaults, penalty, token budget — and the emulated heterogeneity: each
cluster's compute slowdown (constant, plus transient factors on a schedule) and its cross-cluster
link bandwidth (possibly changing over time).

Emulated time (§12, §13).  ``timing.step_s`` is the emulated duration of one inner step at
slowdown 1; a cluster with slowdown s and transient factor f needs ``step_s * s * f`` seconds per
step.  One outer transfer (push or pull) moves the model in BF16, ``2 * param_count *
timing.model_bytes_scale`` emulated bytes, over the cluster's link.  The paper's ratio: a 1B
model (LLaMA3.2-1B, 1.24e9 parameters) in BF16 is 2.47 GB = 19.8 Gbit, 1.98 s one way at
10 Gbit/s; H = 64 inner steps of 32K tokens take ≈ 100 s on one H800 (Emu-S; §11's example: a
cluster finishes 64 steps in 100 s, i.e. 1.56 s per step: 6·N·tokens = 2.4e14 FLOP per step at
≈ 16% of the H800's 989 TFLOPS dense BF16 peak, plausible for a 1B model).  So one transfer at
10 Gbit costs ≈ 2% of a round's compute (push + pull ≈ 4%), 4% at 5 Gbit and 20% at 1 Gbit.
On the Real platform of the weak-scaling experiment the base cluster is 4×RTX 3090 (4 × 71 =
284 TFLOPS dense BF16, 3.5× less than one H800), so a round lasts ≈ 3.5× longer and the same
transfer costs 3.5× less of it.  :func:`paper_bytes_scale` returns the ``model_bytes_scale``
that reproduces the Emu-S ratio for a small model, a given H and step_s.

Scenarios are YAML files validated here (unknown keys refused, errors name the field).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dips.config import DataConfig, InnerConfig, OuterConfig, PenaltySettings
from dips.emu.slowdown import spread
from dips.train.model import ModelConfig

__all__ = [
    "METHODS", "BandwidthChange", "ClusterScenario", "Scenario", "Timing", "Transient",
    "WeakScaling", "load_scenario", "paper_bytes_scale", "PAPER_TRANSFER_OVER_ROUND", "RealTime",
]

Method = Literal["dp", "diloco", "async-diloco", "di-ps", "di-ps-no-penalty", "di-ps-uniform",
                 "di-ps-no-clip", "di-ps-no-grace", "di-ps-pull-barrier"]
METHODS: tuple[str, ...] = ("dp", "diloco", "async-diloco", "di-ps", "di-ps-no-penalty",
                            "di-ps-uniform", "di-ps-no-clip", "di-ps-no-grace", "di-ps-pull-barrier")

# §12/§13: one BF16 transfer of a 1.24e9-parameter model at 10 Gbit/s (1.98 s) over one round
# of H = 64 inner steps (≈ 100 s on one H800).
PAPER_PARAMS = 1.24e9
PAPER_ROUND_S = 100.0
PAPER_TRANSFER_OVER_ROUND = (2 * PAPER_PARAMS * 8 / 10e9) / PAPER_ROUND_S


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Transient(_Strict):
    """An extra compute slowdown ``factor`` (>= 1) on ``[start_s, end_s)`` of emulated time."""

    start_s: float = Field(ge=0)
    end_s: float = Field(gt=0)
    factor: float = Field(ge=1.0)

    @model_validator(mode="after")
    def _ordered(self) -> "Transient":
        if self.end_s <= self.start_s:
            raise ValueError(f"transient: end_s = {self.end_s} must exceed start_s = {self.start_s}")
        return self


class BandwidthChange(_Strict):
    """From emulated time ``at_s`` (seconds) on, the link runs at ``gbit`` Gbit/s."""

    at_s: float = Field(ge=0)
    gbit: float = Field(gt=0)


class ClusterScenario(_Strict):
    """One emulated cluster.

    Attributes:
        id: cluster name; slowdown: constant compute slowdown s >= 1 (§13).
        bandwidth_gbit: cross-cluster link bandwidth at time 0, Gbit/s (1 Gbit = 1e9 bit).
        stages: stage workers (real-time mode; virtual time moves the model as one transfer).
        transient: extra slowdown factors on a schedule (multiplied with ``slowdown``).
        bandwidth_schedule: link changes, applied in ``at_s`` order.
    """

    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    slowdown: float = Field(1.0, ge=1.0)
    bandwidth_gbit: float = Field(10.0, gt=0)
    stages: int = Field(1, ge=1)
    transient: list[Transient] = Field(default_factory=list)
    bandwidth_schedule: list[BandwidthChange] = Field(default_factory=list)

    @field_validator("bandwidth_schedule")
    @classmethod
    def _sorted(cls, v: list[BandwidthChange]) -> list[BandwidthChange]:
        return sorted(v, key=lambda c: c.at_s)

    def slowdown_at(self, t: float) -> float:
        """Compute slowdown (>= 1) at emulated time ``t`` seconds: ``slowdown`` × active transients."""
        f = self.slowdown
        for tr in self.transient:
            if tr.start_s <= t < tr.end_s:
                f *= tr.factor
        return f

    def bandwidth_at(self, t: float) -> float:
        """Link bandwidth in Gbit/s at emulated time ``t`` seconds."""
        g = self.bandwidth_gbit
        for ch in self.bandwidth_schedule:
            if ch.at_s <= t:
                g = ch.gbit
        return g


class Timing(_Strict):
    """Emulated durations (see the module docstring for the paper's ratio).

    Attributes:
        step_s: emulated seconds of one inner step at slowdown 1.
        model_bytes_scale: emulated transfer bytes = 2 (BF16) × param_count × this factor.
        latency_s: fixed per-transfer latency, seconds (0: bandwidth only).
        server_gbit: per-follower link of the parameter server in Gbit/s (None: the clusters'
            links are the bottleneck, as in §13 where the PS sits on a 10–25 Gbit network).
        update_s: emulated seconds of the followers' outer step (aggregate + Nesterov).
    """

    step_s: float = Field(1.5, gt=0)
    model_bytes_scale: float = Field(1.0, gt=0)
    latency_s: float = Field(0.0, ge=0)
    server_gbit: float | None = Field(None, gt=0)
    update_s: float = Field(0.0, ge=0)


class RealTime(_Strict):
    """Real-time mode (:mod:`dips.bench.real`): how emulated seconds and bytes become real ones.

    Attributes:
        time_scale: real seconds per emulated second: an inner step at slowdown 1 lasts
            ``timing.step_s × time_scale`` real seconds (a real model step padded by a delay);
            transient and bandwidth-schedule times are scaled alike.
        payload_bytes: real bytes of one model transfer on the wire (the BF16 tensors padded
            with zeros); None: the model's own BF16 size.  Each link runs at the rate that moves
            ``payload_bytes`` in the emulated transfer time × ``time_scale``.
        measured_step: True: delay proportional to the measured step time
            (:class:`dips.emu.slowdown.Slowdown`) instead of the calibrated step.
        shaping: ``auto`` (kernel tbf in namespaces as root, else token bucket), ``tc-tbf``,
            ``token-bucket`` or ``none``.
        max_time_s: wall-clock limit of one method's run, seconds.
    """

    time_scale: float = Field(0.05, gt=0)
    payload_bytes: int | None = Field(None, ge=1)
    measured_step: bool = False
    shaping: Literal["auto", "tc-tbf", "token-bucket", "none"] = "auto"
    max_time_s: float = Field(600.0, gt=0)


class WeakScaling(_Strict):
    """Weak scaling (§13, §14): run the methods on the first n clusters for each n in ``counts``,
    each with a token budget of ``n × tokens_per_cluster`` (evaluations every
    ``n × eval_every_tokens``)."""

    counts: list[int] = Field(min_length=1)
    tokens_per_cluster: int = Field(ge=1)

    @field_validator("counts")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(n < 1 for n in v) or sorted(set(v)) != v:
            raise ValueError(f"weak_scaling.counts = {v} must be increasing positive integers")
        return v


class Scenario(_Strict):
    """One comparison: shared training setup, methods, emulated clusters and links.

    ``clusters`` lists the clusters explicitly; alternatively ``eta`` and ``n_clusters`` generate
    them (slowdowns spread over [1, 1 + eta/100] by :func:`dips.emu.slowdown.spread`, links taken
    in turn from ``bandwidth_pattern_gbit``).  ``kind: weak-scaling`` with ``weak_scaling.counts``
    runs the methods on growing prefixes of the cluster list.
    """

    name: str = Field(min_length=1)
    kind: Literal["compare", "weak-scaling"] = "compare"
    mode: Literal["virtual", "real"] = "virtual"
    seed: int = Field(0, ge=0)
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    inner: InnerConfig = InnerConfig()
    outer: OuterConfig = OuterConfig()
    penalty: PenaltySettings = PenaltySettings()
    grace_window_s: float = Field(8.0, ge=0)
    followers: int = Field(1, ge=1)
    methods: list[Method] = Field(min_length=1)
    token_budget: int | None = Field(None, ge=1)
    eval_every_tokens: int = Field(ge=1)
    eval_batches: int = Field(8, ge=1)
    eval_batch_size: int = Field(16, ge=1)
    clusters: list[ClusterScenario] = Field(default_factory=list)
    eta: float | None = Field(None, ge=0)
    n_clusters: int | None = Field(None, ge=1)
    bandwidth_pattern_gbit: list[float] = Field(default_factory=lambda: [10.0])
    timing: Timing = Timing()
    real: RealTime = RealTime()
    weak_scaling: WeakScaling | None = None

    @field_validator("methods")
    @classmethod
    def _unique_methods(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"methods = {v} lists a method twice")
        return v

    @field_validator("bandwidth_pattern_gbit")
    @classmethod
    def _positive_bw(cls, v: list[float]) -> list[float]:
        if not v or any(not g > 0 for g in v):
            raise ValueError(f"bandwidth_pattern_gbit = {v} must be non-empty and > 0")
        return v

    @model_validator(mode="after")
    def _resolve(self) -> "Scenario":
        if self.eta is not None or self.n_clusters is not None:
            if self.eta is None or self.n_clusters is None:
                raise ValueError(f"eta = {self.eta} and n_clusters = {self.n_clusters}: give both")
            pattern = self.bandwidth_pattern_gbit
            generated = [
                ClusterScenario(id=f"c{i}", slowdown=s, bandwidth_gbit=pattern[i % len(pattern)])
                for i, s in enumerate(spread(self.eta, self.n_clusters))]
            # A dumped scenario holds both; anything else listed besides eta is a conflict.
            if self.clusters and self.clusters != generated:
                raise ValueError("give either clusters or eta + n_clusters, not both")
            self.clusters = generated
        if not self.clusters:
            raise ValueError("clusters: empty; list clusters or give eta + n_clusters")
        ids = [c.id for c in self.clusters]
        if len(set(ids)) != len(ids):
            raise ValueError(f"clusters: ids {ids} must be unique")
        if self.model.vocab_size != self.data.vocab_size:
            raise ValueError(f"model.vocab_size = {self.model.vocab_size} differs from "
                             f"data.vocab_size = {self.data.vocab_size}")
        if self.inner.seq_len > self.model.max_seq_len:
            raise ValueError(f"inner.seq_len = {self.inner.seq_len} exceeds model.max_seq_len = "
                             f"{self.model.max_seq_len}")
        if self.data.num_chunks < len(self.clusters):
            raise ValueError(f"data.num_chunks = {self.data.num_chunks} is fewer than the "
                             f"{len(self.clusters)} clusters")
        if self.followers > self.model.num_layers + 2:
            raise ValueError(f"followers = {self.followers} exceeds the "
                             f"{self.model.num_layers + 2} layers to shard")
        if self.kind == "weak-scaling":
            if self.weak_scaling is None:
                raise ValueError("kind = weak-scaling needs weak_scaling.counts")
            if self.weak_scaling.counts[-1] > len(self.clusters):
                raise ValueError(f"weak_scaling.counts = {self.weak_scaling.counts} exceeds the "
                                 f"{len(self.clusters)} clusters")
            if self.token_budget is None:  # the largest run's budget; each n gets its own
                self.token_budget = self.weak_scaling.counts[-1] * self.weak_scaling.tokens_per_cluster
        elif self.weak_scaling is not None:
            raise ValueError("weak_scaling is set but kind is not weak-scaling")
        if self.token_budget is None:
            raise ValueError("token_budget: field required (tokens consumed by all clusters)")
        return self

    def with_clusters(self, n: int) -> "Scenario":
        """A copy restricted to the first ``n`` clusters, as a plain comparison (weak scaling)."""
        data = self.model_dump(exclude={"eta", "n_clusters", "weak_scaling", "kind"})
        data["clusters"] = data["clusters"][:n]
        data["name"] = f"{self.name}-n{n}"
        if self.weak_scaling is not None:
            data["token_budget"] = n * self.weak_scaling.tokens_per_cluster
            data["eval_every_tokens"] = n * self.eval_every_tokens
        return Scenario.model_validate(data)

    def transfer_bytes(self, param_count: int) -> float:
        """Emulated bytes of one model transfer (push or pull): 2 × params × model_bytes_scale."""
        return 2.0 * param_count * self.timing.model_bytes_scale

    def transfer_over_round(self, param_count: int, gbit: float = 10.0) -> float:
        """One transfer's seconds at ``gbit`` over one round's compute (H × step_s): cf. §13's 0.02."""
        return self.transfer_bytes(param_count) * 8 / (gbit * 1e9) / (self.inner.H * self.timing.step_s)


def paper_bytes_scale(param_count: int, H: int, step_s: float) -> float:
    """``timing.model_bytes_scale`` giving the paper's transfer/compute ratio (module docstring).

    Solves ``2·P·scale·8 / 10e9 = PAPER_TRANSFER_OVER_ROUND · H · step_s`` for ``scale``.
    """
    return PAPER_TRANSFER_OVER_ROUND * H * step_s * 10e9 / 8 / (2.0 * param_count)


def load_scenario(path: Path | str) -> Scenario:
    """Read and validate a YAML scenario.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a YAML mapping; pydantic.ValidationError (a ValueError) naming the field.
    """
    with open(path) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ValueError(f"scenario {path}: expected a YAML mapping, got {type(data).__name__}")
    return Scenario.model_validate(data)
