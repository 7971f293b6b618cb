"""A Di-PS run: what ``dips launch --config`` reads, what the leader needs, what ``run.json`` holds.

* :class:`RunConfig` — the user's YAML file (``configs/quickstart.yaml``, ``configs/tiny.yaml``),
  composed of the concept models of :mod:`dips.spec` (``model:``, ``data:``, ``inner:``,
  ``outer:``, ``penalty:``, ``grace:``, ``membership:``, ``timeouts:``, ``clusters:``).
* :class:`LeaderConfig` — the part of it the leader uses (§5–§8, §12), built with
  :meth:`LeaderConfig.from_run`; no field of its own besides the follower count.
* :class:`RunSpec` — ``RUN_DIR/run.json``: the resolved config plus what the launcher
  prepared (layer table, follower ownership, ports, token counts).  The launcher writes
  ``RunSpec.model_dump_json()``; every process reads it back with :meth:`RunSpec.read`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from dips.spec.base import Strict, load_yaml
from dips.spec.cluster import ClusterConfig
from dips.spec.evaluate import EvaluateConfig
from dips.spec.fingerprint import Fingerprint, ModelFacts
from dips.spec.protocol import GraceConfig, MembershipConfig, Timeouts
from dips.spec.training import (
    DataConfig,
    InnerConfig,
    ModelConfig,
    OuterConfig,
    PenaltyConfig,
    check_training,
)

__all__ = ["LeaderConfig", "PUSH_TOKENS_SLACK", "RunConfig", "RunSpec", "TBF_MIN_BPS",
           "load_config"]

#: The lowest rate (bits/s) ``tc tbf`` accepts (:mod:`dips.emu.netns`).
TBF_MIN_BPS = 8000.0

#: Sync intervals one push may carry at most (a cluster keeps training while a push request or
#: verdict is retried with backoff): ``max_push_tokens`` = this × H × batch_size × seq_len.
PUSH_TOKENS_SLACK = 4


def _default_clusters() -> list[ClusterConfig]:
    return [ClusterConfig(id=f"c{i}", slowdown=s) for i, s in enumerate((1.0, 1.33, 1.67, 2.0))]


class RunConfig(Strict):
    """A whole Di-PS run on one machine (``dips launch``); unknown keys are refused."""

    name: str = Field("run", description="run name (logs, summary)")
    seed: int = Field(0, description="seed of the model initialization and the batch samplers")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the trained model")
    data: DataConfig = Field(default_factory=DataConfig, description="tokenizer, chunks, leases")
    inner: InnerConfig = Field(default_factory=InnerConfig, description="the inner AdamW loop")
    outer: OuterConfig = Field(default_factory=OuterConfig, description="the outer Nesterov step")
    penalty: PenaltyConfig = Field(default_factory=PenaltyConfig, description="the §8 penalty")
    grace: GraceConfig = Field(default_factory=GraceConfig, description="the §7 grace window")
    membership: MembershipConfig = Field(default_factory=MembershipConfig,
                                         description="heartbeats and failure detection (§12)")
    checkpoint_keep: int = Field(3, ge=2, description="follower checkpoints kept")
    supervise: bool = Field(True, description="restart a process that exits (as an orchestrator)")
    network: Literal["loopback", "netns"] = Field(
        "loopback", description="loopback: every process on 127.0.0.1; netns (root): each "
                                "cluster in its own network namespace, its link shaped by tc tbf")
    followers: int = Field(2, ge=1, description="follower processes the model is sharded over")
    clusters: list[ClusterConfig] = Field(default_factory=_default_clusters,
                                          description="the training clusters")
    step_s: float | None = Field(None, gt=0, description="calibrated seconds of an inner step at "
                                                         "slowdown 1 (real-time pacing); None: "
                                                         "measured")
    token_budget: int = Field(2_000_000, ge=1, description="stop when this many tokens were "
                                                           "accepted into the global model (the "
                                                           "ledger's count, never a member's "
                                                           "own report)")
    max_time_s: float | None = Field(None, gt=0, description="stop this many seconds after "
                                                             "the first push request")
    max_outer_steps: int | None = Field(
        None, ge=1, description="stop once the leader reports this many outer steps (versions "
                                "applied); None: no limit. Stops on the event, not on a "
                                "duration: tests use it with max_time_s as a safety limit")
    data_encryption: Literal["aes-gcm", "off"] = Field(
        "aes-gcm", description="aes-gcm: members encrypt tensor bytes on the data plane "
                               "(with TLS; --insecure never does); off: authenticated only")
    eval_batches: int = Field(8, ge=1, description="validation batches per evaluation")
    eval_batch_size: int = Field(16, ge=1, description="sequences per validation batch")
    evaluate: EvaluateConfig | None = Field(None, description="dips launch starts the periodic "
                                                          "evaluator (issue 15); None: none")
    timeouts: Timeouts = Field(default_factory=Timeouts, description="seconds per blocking phase")

    @field_validator("clusters")
    @classmethod
    def _unique_ids(cls, v: list[ClusterConfig]) -> list[ClusterConfig]:
        ids = [c.id for c in v]
        if len(set(ids)) != len(ids) or not ids:
            raise ValueError(f"clusters: ids {ids} must be non-empty and unique")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "RunConfig":
        check_training(self.model, self.data, self.inner, self.followers)
        if self.network == "netns":
            for c in self.clusters:
                for bps in (c.link.rates() if c.link is not None else []):
                    if bps < TBF_MIN_BPS:
                        raise ValueError(f"cluster {c.id!r}: link rate {bps} bit/s is below the "
                                         "8000 bit/s that tc tbf accepts (network: netns)")
        return self

    def cluster(self, cluster_id: str) -> ClusterConfig:
        """The cluster named ``cluster_id``.  Raises KeyError naming it."""
        for c in self.clusters:
            if c.id == cluster_id:
                return c
        raise KeyError(f"cluster {cluster_id!r} is not in the run config")


def load_config(path: Path | str) -> RunConfig:
    """Read a YAML run config.  Raises OSError, or :class:`dips.spec.base.SpecError` naming the
    file and line of a YAML error, or each failing field with its value."""
    return load_yaml(path, RunConfig)


class LeaderConfig(Strict):
    """What the leader needs (§5–§8, §12): every field is a concept model of the run config."""

    grace: GraceConfig = Field(default_factory=GraceConfig, description="the §7 grace window")
    penalty: PenaltyConfig = Field(default_factory=PenaltyConfig, description="the §8 penalty")
    outer: OuterConfig = Field(default_factory=OuterConfig,
                               description="max_norm (clip) and uniform_weights of the decision")
    membership: MembershipConfig = Field(default_factory=MembershipConfig,
                                         description="heartbeats and failure detection")
    timeouts: Timeouts = Field(default_factory=Timeouts,
                               description="push_s / pull_s: the waits for a round's pushes/pulls")
    followers: int = Field(1, ge=1, description="followers the model is sharded over")
    token_budget: int | None = Field(None, ge=1, description="the run ends once this many "
                                                             "tokens were accepted; None: never")
    max_outer_steps: int | None = Field(None, ge=1, description="the run ends after this many "
                                                                "outer steps; None: no limit")
    max_time_s: float | None = Field(None, gt=0, description="the run ends this many seconds "
                                                             "after its first push request")
    max_push_tokens: int | None = Field(
        None, ge=1, description="the most tokens one push may carry (T_j, tokens): a claim above "
                                "it is cut to it when there is no ledger, and it bounds the chunks "
                                "a member may hold; from a run config: PUSH_TOKENS_SLACK × H × "
                                "batch_size × seq_len; None: 2**63 - 1")
    push_tokens_weighed: int | None = Field(
        None, ge=1, description="the most tokens one push weighs in the mean (§6 weights T_j; "
                                "tokens): one sync interval of one cluster, H × batch_size × "
                                "seq_len from a run config. A member may be credited up to "
                                "max_push_tokens (a push retried after a failure carries "
                                "more), but weighs no more than an honest interval: a token "
                                "claim and the push-norm radius would otherwise multiply "
                                "(review 20). None: max_push_tokens")
    lease_ahead: int | None = Field(None, ge=1, description="unfinished chunks a member keeps "
                                                            "leased (data.lease_ahead); None: a "
                                                            "lease is not capped")
    lease_timeout_s: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="seconds without an accepted advance after which a member's chunks go to "
                    "a member that asks once none is free (data.lease_timeout_s); None: never")
    configured_clusters: int = Field(
        0, ge=0, description="the run's configured clusters (``clusters:``; clusters added "
                             "with `dips init --add-cluster` count once joined): the robust "
                             "scale of issue 13 waits until half of them, or of the members "
                             "joined if more, and at least two have pushed")

    @classmethod
    def from_run(cls, cfg: RunConfig) -> "LeaderConfig":
        """The leader's part of a run config (the same concept models, not copies)."""
        inner = cfg.inner
        return cls(grace=cfg.grace, penalty=cfg.penalty, outer=cfg.outer,
                   membership=cfg.membership, timeouts=cfg.timeouts, followers=cfg.followers,
                   token_budget=cfg.token_budget, max_outer_steps=cfg.max_outer_steps,
                   max_time_s=cfg.max_time_s,
                   max_push_tokens=PUSH_TOKENS_SLACK * inner.H * inner.batch_size * inner.seq_len,
                   push_tokens_weighed=inner.H * inner.batch_size * inner.seq_len,
                   lease_ahead=cfg.data.lease_ahead, lease_timeout_s=cfg.data.lease_timeout_s,
                   configured_clusters=len(cfg.clusters))


class RunSpec(Strict):
    """The run as the leader serves it to every member (``GetSpec``), kept as ``run.json`` in
    the leader's state directory: the resolved config and what was prepared from it.

    Written once by :func:`dips.emu.prepare.prepare` (the leader's first start, or
    ``dips launch``); no path in it is used by another host. A layer is ``(layer key,
    [parameter names], FP32 bytes)`` in model order (:func:`dips.train.model.layer_table`).
    """

    config: RunConfig = Field(description="the validated run config")
    cache_dir: Path | None = Field(None, description="the preparing host's tokenizer/corpus "
                                                     "cache (others use their own)")
    layers: list[tuple[str, list[str], int]] = Field(
        description="per layer: key, parameter names, FP32 bytes")
    follower_layers: list[list[str]] = Field(description="layer keys owned by each follower")
    init: str = Field("init/model.safetensors",
                      description="version 0 of θ, relative to the preparing host's directory")
    eval_loss_initial: float = Field(description="validation loss of version 0, nats/token")
    train_tokens: int = Field(ge=0, description="training tokens (tokens)")
    data_digest: str | None = Field(
        None, pattern=r"^[0-9a-f]{64}$",
        description="SHA-256 (hex) of the token streams' lengths and sampled blocks "
                    "(dips.train.datasource.token_digest): every process that trains or "
                    "evaluates checks its own copy of the data against it (None: a spec "
                    "written before it existed, only the length is checked)")
    val_tokens: int = Field(ge=0, description="validation tokens (tokens)")
    params: int = Field(ge=1, description="model parameters")
    model: ModelFacts | None = Field(
        None, description="the model as built or loaded: architecture, sizes, parameters "
                          "(for model.pretrained the directory's, not config.model's unused "
                          "defaults; None: a spec written before it existed)")
    windows_per_chunk: int = Field(ge=0, description="windows (seq_len + 1 tokens) per chunk")
    fingerprint: Fingerprint | None = Field(None, description="the model's fingerprint "
                                                              "(None: not checked at join)")

    @model_validator(mode="after")
    def _consistent(self) -> "RunSpec":
        n = self.config.followers
        if len(self.follower_layers) != n:
            raise ValueError(f"follower_layers ({len(self.follower_layers)}) must list the {n} "
                             "followers")
        return self

    def write(self, path: Path) -> None:
        """Write ``path`` (``run.json``) as JSON."""
        Path(path).write_text(self.model_dump_json(indent=1))

    @classmethod
    def read(cls, path: Path) -> "RunSpec":
        """Read and validate ``run.json``.  Raises OSError, pydantic.ValidationError."""
        return cls.model_validate_json(Path(path).read_text())
