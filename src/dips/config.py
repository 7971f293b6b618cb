"""Run configuration (pydantic): what ``dips launch --config FILE`` reads.

Defaults follow the seed (§8: α=0.02, β=3; §13: outer lr 0.7, momentum 0.8, H=64) except
where a 1–2M-parameter model on 2 CPU cores needs otherwise (inner lr, H, batch); those are
set in ``configs/quickstart.yaml``. Unknown keys are refused (a typo must not silently fall
back to a default).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dips.train.model_config import ModelConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataConfig(_Strict):
    """Tokenizer and data chunks (§12: many more chunks than clusters)."""

    vocab_size: int = Field(4096, ge=256, le=65535)
    num_chunks: int = Field(64, ge=1)
    val_fraction: float = Field(0.02, gt=0, lt=0.5)
    max_train_tokens: int | None = Field(None, ge=1024)
    cache_dir: Path = Path(".cache/dips")


class InnerConfig(_Strict):
    """Inner loop: fused AdamW for H steps between pushes (§3)."""

    H: int = Field(64, ge=1)
    batch_size: int = Field(8, ge=1)
    seq_len: int = Field(128, ge=8)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float | None = 1.0


class OuterConfig(_Strict):
    """Outer Nesterov step and aggregation (§6, §8)."""

    lr: float = Field(0.7, gt=0)
    momentum: float = Field(0.8, ge=0, lt=1)
    max_norm: float | None = Field(1.0, gt=0)
    uniform_weights: bool = False


class PenaltySettings(_Strict):
    """§8 anomaly test on ‖Δ‖²."""

    enabled: bool = True
    alpha: float = Field(0.02, gt=0, le=1)
    beta: float = Field(3.0, gt=0)
    warmup: int = Field(3, ge=1)


class ClusterSpec(_Strict):
    """One cluster: its id, compute slowdown factor (>= 1), stage workers, optional transient
    slowdowns ``(start_s, end_s, factor)`` in seconds of training, and an optional link rate
    ``link_bps`` (bits/s): with ``network: loopback`` an application-level token bucket on its
    data plane (upload), with ``network: netns`` the tc tbf of its veth (both directions).

    ``link_schedule``: ``(at_s, link_bps)`` pairs; from ``at_s`` seconds after the run's
    training start (the launcher's ``train_start``, the origin of ``transient`` too) the link
    runs at that rate (a bandwidth schedule, :mod:`dips.emu.link_schedule`).  It needs
    ``link_bps``; entries are kept sorted by ``at_s``.
    """

    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    slowdown: float = Field(1.0, ge=1.0)
    stages: int = Field(1, ge=1)
    transient: list[tuple[float, float, float]] = Field(default_factory=list)
    link_bps: float | None = Field(None, gt=0)
    link_schedule: list[tuple[float, float]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _valid_link_schedule(self) -> ClusterSpec:
        for at, bps in self.link_schedule:
            if not (math.isfinite(at) and at >= 0 and math.isfinite(bps) and bps > 0):
                raise ValueError(f"cluster {self.id!r}: link_schedule entry {(at, bps)!r} needs "
                                 "a finite at_s >= 0 and link_bps > 0")
        if self.link_schedule and self.link_bps is None:
            raise ValueError(f"cluster {self.id!r}: link_schedule = {self.link_schedule!r} needs "
                             "link_bps (the rate before the first change)")
        self.link_schedule = sorted(self.link_schedule)
        return self

    def link_bps_at(self, t: float) -> float | None:
        """Link rate (bits/s) at ``t`` seconds after the training start; None: unshaped."""
        rate = self.link_bps
        for at, bps in self.link_schedule:
            if at <= t:
                rate = bps
        return rate


class Timeouts(_Strict):
    """Seconds for each blocking phase."""

    rpc_s: float = Field(120.0, gt=0)
    admit_s: float = Field(30.0, gt=0)
    push_s: float = Field(60.0, gt=0)
    pull_s: float = Field(60.0, gt=0)
    startup_s: float = Field(180.0, gt=0)
    shutdown_s: float = Field(30.0, gt=0)


class RunConfig(_Strict):
    """A whole Di-PS run on one machine (``dips launch``)."""

    name: str = "run"
    seed: int = 0
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    inner: InnerConfig = InnerConfig()
    outer: OuterConfig = OuterConfig()
    penalty: PenaltySettings = PenaltySettings()
    grace_window_s: float = Field(1.0, ge=0)
    grace_mode: Literal["fixed", "dynamic"] = "fixed"  # §7: dynamic = τ* = ln(C_m·λ)/λ
    grace_max_s: float = Field(30.0, ge=0)             # clamp of the dynamic window
    # True: the seed's §6 round (no new window until every cluster of the round pulled);
    # False: the next window opens once the update is committed (a slow pull delays only its
    # own cluster; followers serve each version's snapshot until its pulls are done).
    pull_barrier: bool = False
    heartbeat_interval_s: float = Field(1.0, gt=0)
    missed_heartbeats: int = Field(3, ge=1)
    checkpoint_keep: int = Field(3, ge=2)
    lease_ahead: int = Field(2, ge=1)
    supervise: bool = True
    # loopback: every process on 127.0.0.1. netns (root): each cluster in its own network
    # namespace joined by veth to the servers' namespace, links shaped by tc tbf (link_bps).
    network: Literal["loopback", "netns"] = "loopback"
    followers: int = Field(2, ge=1)
    clusters: list[ClusterSpec] = Field(default_factory=lambda: [
        ClusterSpec(id=f"c{i}", slowdown=s) for i, s in enumerate((1.0, 1.33, 1.67, 2.0))])
    step_s: float | None = Field(None, gt=0)  # calibrated inner-step seconds (real-time mode)
    token_budget: int = Field(2_000_000, ge=1)
    max_time_s: float | None = Field(None, gt=0)
    eval_batches: int = Field(8, ge=1)
    eval_batch_size: int = Field(16, ge=1)
    timeouts: Timeouts = Timeouts()

    @field_validator("clusters")
    @classmethod
    def _unique_ids(cls, v: list[ClusterSpec]) -> list[ClusterSpec]:
        ids = [c.id for c in v]
        if len(set(ids)) != len(ids) or not ids:
            raise ValueError(f"clusters: ids {ids} must be non-empty and unique")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "RunConfig":
        if self.model.vocab_size != self.data.vocab_size:
            raise ValueError(f"model.vocab_size = {self.model.vocab_size} differs from "
                             f"data.vocab_size = {self.data.vocab_size}")
        if self.inner.seq_len > self.model.max_seq_len:
            raise ValueError(f"inner.seq_len = {self.inner.seq_len} exceeds model.max_seq_len = "
                             f"{self.model.max_seq_len}")
        if self.network == "netns":  # tc tbf takes no rate below 8000 bit/s (dips.emu.netns)
            for c in self.clusters:
                for field, bps in [("link_bps", c.link_bps), *(("link_schedule", b) for _, b in c.link_schedule)]:
                    if bps is not None and bps < 8000:
                        raise ValueError(f"cluster {c.id!r}: {field} rate {bps} bit/s is below the "
                                         "8000 bit/s that tc tbf accepts (network: netns)")
        n_layers = self.model.num_layers + 2
        if self.followers > n_layers:
            raise ValueError(f"followers = {self.followers} exceeds the {n_layers} layers to shard")
        return self


def load_config(path: Path) -> RunConfig:
    """Read a YAML run config. Raises FileNotFoundError or pydantic.ValidationError."""
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    return RunConfig.model_validate(data)
