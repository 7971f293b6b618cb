"""What every method trains with: the model, data, inner AdamW, outer Nesterov, the §8 penalty.

One model per concept, shared by ``dips launch`` (:class:`dips.spec.run.RunConfig`), the
comparison scenarios (:class:`dips.spec.scenario.Scenario`), the real-time baselines
(:class:`dips.spec.worker.WorkerSpec`) and the pure decisions of :mod:`dips.algo`
(:func:`dips.algo.penalty.decide` takes a :class:`PenaltyConfig`).

:class:`ModelConfig` is kept free of torch and transformers so that processes which only read
configuration (the leader, the launcher's CLI parsing) start fast;
:func:`dips.train.model.build_model` builds the model from it.

Defaults follow the seed (§8: α = 0.02, β = 3; §13: outer lr 0.7, momentum 0.8, clip 1,
H = 64) except where a 1–2M-parameter model on 2 CPU cores needs otherwise (inner lr, batch,
sequence length); the shipped YAML files set those.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_serializer, model_validator

from dips.spec.base import Strict

__all__ = ["DataConfig", "InnerConfig", "ModelConfig", "OuterConfig", "PenaltyConfig",
           "check_training"]


class ModelConfig(Strict):
    """Size of a decoder-only LM (§13 architectures, scaled down), an HF config of another
    architecture, or a user's pretrained model directory (issue 14); validated, extra keys
    forbidden.

    Defaults give 1,250,432 parameters (LLaMA) / 1,250,688 (Qwen3) at vocab 4096.
    Raises ``pydantic.ValidationError`` (a ValueError) naming the field and value on bad input,
    also on assignment.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    arch: Literal["llama", "qwen3", "hf"] = Field(
        "llama", description="llama: HF LlamaForCausalLM; qwen3: Qwen3ForCausalLM (adds per-head "
                             "q/k RMSNorm), both from the sizes below; hf: any "
                             "AutoModelForCausalLM from hf_config or pretrained (issue 14; "
                             "the default when pretrained is given)")
    pretrained: Path | None = Field(
        None, description="arch hf: a local directory of an AutoModelForCausalLM "
                          "(save_pretrained: config.json + *.safetensors), loaded offline with "
                          "from_pretrained as version 0 of the global model; every host that "
                          "builds the model (preparing leader, followers without --init, "
                          "clusters) needs it at this path; vocab_size below must equal its "
                          "config's")
    hf_config: dict[str, Any] | None = Field(
        None, description="arch hf: the transformers config as a mapping with its "
                          "'model_type' (e.g. {model_type: gpt2, n_embd: 64, n_layer: 2, "
                          "n_head: 4, n_positions: 256}); vocab_size below overrides its "
                          "vocabulary; the sizes below are not used")
    layer_pattern: str | None = Field(
        None, description="a regex whose group 1 is the decoder block's index, matched at "
                          "the start of parameter names (e.g. '^transformer\\.h\\.(\\d+)\\.'), "
                          "for a model whose blocks are not one ModuleList; None: found in the "
                          "module tree (dips.roles.layers.layer_namer)")
    hidden_size: int = Field(128, gt=0, description="model width (features)")
    intermediate_size: int = Field(344, gt=0, description="SwiGLU MLP width (features)")
    num_layers: int = Field(4, gt=0, description="decoder layers")
    num_heads: int = Field(4, gt=0, description="query heads (a multiple of num_kv_heads)")
    num_kv_heads: int = Field(2, gt=0, description="key/value heads (grouped-query attention)")
    head_dim: int | None = Field(None, gt=0, description="per-head width (features); None: "
                                                         "hidden_size // num_heads")
    vocab_size: int = Field(4096, ge=2, description="token ids (tokens); equals data.vocab_size")
    max_seq_len: int = Field(256, gt=0, description="longest sequence (tokens), used as "
                                                    "max_position_embeddings")
    tie_embeddings: bool = Field(True, description="share the input embedding and the LM head")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base (dimensionless)")

    @model_validator(mode="before")
    @classmethod
    def _pretrained_is_hf(cls, data: Any) -> Any:
        # ``model: {pretrained: PATH}`` alone means arch hf: the directory holds the config.
        if isinstance(data, dict) and data.get("pretrained") is not None and "arch" not in data:
            data = {**data, "arch": "hf"}
        return data

    @model_validator(mode="after")
    def _check_heads(self) -> "ModelConfig":
        if self.pretrained is not None:  # the sizes come from the directory's config.json
            unused = [f"{k} = {getattr(self, k)!r}" for k in _SIZES if k in self.model_fields_set
                      and getattr(self, k) != type(self).model_fields[k].default]
            if unused:
                raise ValueError(f"model.{', model.'.join(unused)}: not used with "
                                 f"model.pretrained (its config.json has the sizes); remove it")
        if self.pretrained is not None:
            if self.arch != "hf":
                raise ValueError(f"model.pretrained = {str(self.pretrained)!r} is for arch hf, "
                                 f"not arch {self.arch!r}")
            if self.hf_config is not None:
                raise ValueError("model.pretrained and model.hf_config exclude each other (the "
                                 f"directory {str(self.pretrained)!r} holds the config)")
        elif self.arch == "hf":
            kind = (self.hf_config or {}).get("model_type")
            if not isinstance(kind, str) or not kind:
                raise ValueError(f"model.hf_config must name its model_type (arch hf), got "
                                 f"{self.hf_config!r}")
        elif self.hf_config is not None:
            raise ValueError(f"model.hf_config is for arch hf, not arch {self.arch!r}")
        if self.layer_pattern is not None:
            try:
                groups = re.compile(self.layer_pattern).groups
            except re.error as exc:
                raise ValueError(f"model.layer_pattern {self.layer_pattern!r} does not compile: "
                                 f"{exc}") from None
            if groups < 1:
                raise ValueError(f"model.layer_pattern {self.layer_pattern!r} has no group for "
                                 "the block index")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads} "
                "when head_dim is None"
            )
        if self.resolved_head_dim % 2:
            raise ValueError(f"head_dim={self.resolved_head_dim} must be even for RoPE")
        return self

    @model_serializer(mode="wrap")
    def _without_unused_sizes(self, handler: Any) -> dict[str, Any]:
        # With ``pretrained`` the sizes are the directory's (run.json's ``model`` records
        # them): their defaults here are not written, so no reader takes them for the model's.
        data = handler(self)
        if self.pretrained is not None and isinstance(data, dict):
            for key in _SIZES:
                data.pop(key, None)
        return data

    @property
    def resolved_head_dim(self) -> int:
        """Per-head width actually used: ``head_dim`` or ``hidden_size // num_heads``."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads


#: ModelConfig's sizes of the built-in architectures; arch hf takes them from its own config.
_SIZES = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
          "head_dim", "max_seq_len", "tie_embeddings", "rope_theta")


class DataConfig(Strict):
    """Tokenizer, token stream and data chunks (§12: many more chunks than clusters).

    ``format`` names where the tokens come from (issue 14: bring your own data):

    * ``bundled`` (default, the demo): the two bundled corpora and a byte-level BPE of
      ``vocab_size`` trained on them (:mod:`dips.train.corpus`);
    * ``text`` / ``json`` / ``parquet``: local files read by HF ``datasets`` (text: documents
      split as ``sample_by`` says; json: JSON lines; the ``text_field`` column of each record),
      tokenised once with ``AutoTokenizer.from_pretrained(tokenizer)`` into a ``numpy.memmap``
      cache (:mod:`dips.train.tokenize_files`);
    * ``tokens``: pre-tokenised ids, the nanoGPT layout: ``path``/train.bin and
      ``path``/val.bin, flat arrays of ``token_dtype`` (:mod:`dips.train.datasource`).

    Raises ``pydantic.ValidationError`` (a ValueError) naming the field and value.
    """

    format: Literal["bundled", "text", "json", "parquet", "tokens"] = Field(
        "bundled", description="bundled: the demo corpora; text|json|parquet: local files "
                               "through HF datasets and a tokenizer directory; tokens: "
                               "pre-tokenised train.bin/val.bin (numpy.memmap)")
    path: str | None = Field(
        None, description="text|json|parquet: a local file, a directory (its files of that "
                          "format, sorted) or a glob pattern; tokens: the directory holding "
                          "train.bin and val.bin. Every host that trains (or prepares) reads "
                          "it at this path")
    tokenizer: Path | None = Field(
        None, description="a local directory for transformers.AutoTokenizer.from_pretrained "
                          "(required for text|json|parquet; for tokens optional: its "
                          "vocabulary then goes into the model fingerprint and the export)")
    text_field: str = Field("text", min_length=1,
                            description="json|parquet: the column holding each document's text")
    sample_by: Literal["paragraph", "line", "document"] = Field(
        "paragraph", description="text: what one document is (datasets' text builder); "
                                 "document reads a whole file at once")
    token_dtype: Literal["uint16", "uint32"] = Field(
        "uint16", description="tokens: the dtype of train.bin/val.bin (uint16 holds ids < 65536)")
    vocab_size: int = Field(4096, ge=256, le=2**31 - 1,
                            description="token ids (tokens): bundled: the BPE's vocabulary; "
                                        "otherwise the model's embedding rows, which every id "
                                        "of the data (and the tokenizer) must be below")
    num_chunks: int = Field(64, ge=1, description="chunks the training stream is cut into; "
                                                  "each is leased to one cluster at a time")
    val_fraction: float = Field(0.02, gt=0, lt=0.5,
                                description="held-out fraction of every document (validation); "
                                            "tokens: val.bin is the held-out split")
    max_train_tokens: int | None = Field(None, ge=1024, description="cap on training tokens "
                                                                    "(tokens); None: all")
    cache_dir: Path = Field(Path(".cache/dips"), description="tokenizer and encoded-corpus cache "
                                                             "(text|json|parquet: the memmap "
                                                             "of their tokens)")
    lease_ahead: int = Field(2, ge=1, description="unfinished chunks a cluster holds at a time "
                                                  "(the leader's data ledger, dips launch)")
    lease_timeout_s: float | None = Field(
        30.0, gt=0, allow_inf_nan=False,
        description="seconds a member's accepted data position may stand still before, once no "
                    "chunk is free, its chunks are leased to a member that asks (review 14, F3: a "
                    "lease without progress must not keep the epoch from ending); a floor: a "
                    "member also keeps them for 3 of its own intervals between accepted pushes; "
                    "None: never reassigned")

    @model_validator(mode="after")
    def _check_source(self) -> "DataConfig":
        if self.format == "bundled":
            for name in ("path", "tokenizer"):
                if getattr(self, name) is not None:
                    raise ValueError(f"data.{name} = {str(getattr(self, name))!r} needs a data."
                                     "format other than bundled (text, json, parquet, tokens)")
            return self
        if self.path is None:
            raise ValueError(f"data.format = {self.format!r} needs data.path")
        if self.format != "tokens" and self.tokenizer is None:
            raise ValueError(f"data.format = {self.format!r} needs data.tokenizer (a local "
                             "directory for AutoTokenizer.from_pretrained)")
        if self.format == "tokens" and self.token_dtype == "uint16" and self.vocab_size > 65536:
            raise ValueError(f"data.vocab_size = {self.vocab_size} does not fit data.token_dtype "
                             "= 'uint16' (ids < 65536): use uint32")
        return self


class InnerConfig(Strict):
    """Inner loop: fused AdamW for H steps between pushes (§3)."""

    H: int = Field(64, ge=1, description="inner steps between two pushes")
    batch_size: int = Field(8, ge=1, description="sequences per inner step")
    seq_len: int = Field(128, ge=8, description="tokens per sequence (a window is seq_len + 1)")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay")
    grad_clip: float | None = Field(1.0, description="gradient-norm clip of each inner step; "
                                                     "None: no clip")
    hold_after: int | None = Field(
        1, ge=1, strict=True,
        description="sync intervals (of H inner steps) a Di-PS cluster trains past its last "
                    "completed sync before it holds: no further inner step, its data position "
                    "kept, the sync tried again until it completes (the leader back, the "
                    "followers ready); it also holds while a verdict or a re-join is pending, "
                    "whose outcome throws away what it would train (dips.algo.hold). None: "
                    "never hold (the next push carries the whole outage; the penalty may "
                    "reject it)")


class OuterConfig(Strict):
    """The outer Nesterov step and the aggregation (§6, §8, §13 of the seed).

    Defaults chosen by the sweeps of CONVERGENCE.md (issue 12): the global clip of δ is
    relative (``clip: relative``, ‖δ‖ ≤ ``clip_ratio`` × √μ: the seed's fixed norm 1 binds on
    every step at any model size but the paper's; ``clip: seed`` restores §8's ``max_norm``,
    None or ``math.inf`` for no clip, an ablation), and a step of stale pushes is scaled by
    1/(1 + their mean staleness) (``staleness: inverse``; ``none``, the seed, applies it at
    full weight).  Used by the followers (lr, momentum, state_dtype), the leader (the clip,
    staleness, uniform_weights), the clusters (wire_dtype) and every baseline's replicated
    outer optimizer.  Errors name the field (pydantic ValidationError, a ValueError).
    """

    lr: float = Field(0.7, gt=0, allow_inf_nan=False, description="outer learning rate")
    momentum: float = Field(0.8, ge=0, lt=1, allow_inf_nan=False,
                            description="Nesterov momentum, in [0, 1)")
    max_norm: float | None = Field(1.0, gt=0, description="global clip norm c of δ (§8: "
                                                          "factor min(1, c/‖δ‖₂)); None: no clip")
    clip: Literal["seed", "relative"] = Field(
        "relative", description="relative (default): clip ‖δ‖ to clip_ratio × √μ, μ the §8 EMA "
                                "of the pushes' ‖Δ‖² (scale-free; CONVERGENCE.md); seed: to "
                                "max_norm (§8)")
    clip_ratio: float = Field(0.4, gt=0, allow_inf_nan=False,
                              description="relative clip: the threshold as a fraction of √μ "
                                          "(0.4: chosen by the clip sweep, CONVERGENCE.md)")
    staleness: Literal["none", "inverse"] = Field(
        "inverse", description="inverse (default): the step scaled by 1/(1 + s̄), s̄ the accepted "
                               "pushes' token-weighted staleness in versions (CONVERGENCE.md); "
                               "none: a stale pseudo-gradient at full weight (the seed)")
    uniform_weights: bool = Field(False, description="ablation: weights 1/n instead of the "
                                                     "token weights T_j/ΣT (§8)")
    push_norm_ratio: float | None = Field(
        2.0, gt=1, allow_inf_nan=False,
        description="each accepted pseudo-gradient is scaled to at most this × √μ_robust, "
                    "the relative clip's μ is capped at its square × μ_robust, and no ‖Δ_j‖² "
                    "enters the penalty's statistics above that (μ_robust: the median of the "
                    "clusters' own mean ‖Δ_j‖², which fewer than half of the members cannot "
                    "lift; issue 13); None: none of these bounds")
    wire_dtype: Literal["bf16", "fp32"] = Field(
        "bf16", description="dtype of the parameters clusters push and pull (§12: BF16 halves "
                            "the bytes; fp32: exact, twice the bytes)")
    state_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="precision of the followers' θ and Nesterov momentum (§12: FP32); "
                            "bf16 rounds both to BF16 after every outer step (§15's BF16+BF16 "
                            "precision ablation; the buffers stay FP32 in memory)")


class PenaltyConfig(Strict):
    """Parameters of the anomaly test on ‖Δ‖² (§8 of the seed; :func:`dips.algo.penalty.decide`).

    Semantics of each field are in :mod:`dips.algo.penalty`'s docstring.  Errors name the field
    (pydantic ValidationError, a ValueError).
    """

    enabled: bool = Field(True, strict=True, description="False (ablation): accept every "
                                                          "cluster, still computing the scores")
    alpha: float = Field(0.02, gt=0, le=1, allow_inf_nan=False,
                         description="EMA rate of μ and σ, in (0, 1]")
    beta: float = Field(3.0, gt=0, allow_inf_nan=False,
                        description="threshold multiplier: reject if E_j > β·max(recent E)")
    warmup: int = Field(3, ge=1, strict=True,
                        description="G values observed before scoring starts (all accepted)")
    recent: int = Field(16, ge=1, strict=True,
                        description="length of the accepted-score history")
    score_floor: float = Field(1.0, gt=0, allow_inf_nan=False,
                               description="lower bound of max(recent E) in the threshold")
    sigma_floor_rel: float = Field(0.05, ge=0, allow_inf_nan=False,
                                   description="σ is kept >= sigma_floor_rel · μ")


def check_training(model: ModelConfig, data: DataConfig, inner: InnerConfig, followers: int) -> None:
    """The cross-field rules every run and scenario shares. Raises ValueError naming the fields:
    the model's vocabulary must be the tokenizer's, a training sequence must fit the model's
    context, and the model must have at least one layer per follower to shard (§5) (for
    ``arch: hf`` the last two are checked on the built model: :func:`dips.train.model.check_built`)."""
    if model.vocab_size != data.vocab_size:
        raise ValueError(f"model.vocab_size = {model.vocab_size} differs from "
                         f"data.vocab_size = {data.vocab_size}")
    if model.arch == "hf":
        return  # sizes live in hf_config: dips.train.model.check_built checks the built model
    if inner.seq_len > model.max_seq_len:
        raise ValueError(f"inner.seq_len = {inner.seq_len} exceeds model.max_seq_len = "
                         f"{model.max_seq_len}")
    if followers > model.num_layers + 2:
        raise ValueError(f"followers = {followers} exceeds the {model.num_layers + 2} layers "
                         "to shard")
