"""The size of a decoder-only language model (§13 architectures, scaled down).

Kept free of torch and transformers so that processes which only read configuration (the
leader, the launcher's CLI parsing) start fast; :mod:`dips.train.model` builds the model.
"""

from __future__ import annotations

from typing import Literal

import pydantic

__all__ = ["ModelConfig"]


class ModelConfig(pydantic.BaseModel):
    """Size of a decoder-only LM (§13 architectures, scaled down); validated, extra keys forbidden.

    Fields (all counts are plain ints):
        arch: ``"llama"`` (``LlamaForCausalLM``) or ``"qwen3"`` (``Qwen3ForCausalLM``, adds
            per-head q/k RMSNorm).
        hidden_size: model width; intermediate_size: SwiGLU MLP width.
        num_layers: decoder layers; num_heads / num_kv_heads: query / key-value heads
            (grouped-query attention; num_heads must be a multiple of num_kv_heads).
        head_dim: per-head width; None means ``hidden_size // num_heads`` (then hidden_size
            must be divisible by num_heads).
        vocab_size: token ids (tokens); max_seq_len: longest sequence (tokens), used as
            ``max_position_embeddings``.
        tie_embeddings: share the input embedding and the LM head matrix.
        rope_theta: RoPE base (dimensionless).

    Defaults give 1,250,432 parameters (LLaMA) / 1,250,688 (Qwen3) at vocab 4096.
    Raises ``pydantic.ValidationError`` (a ValueError) naming the field and value on bad input,
    also on assignment.
    """

    model_config = pydantic.ConfigDict(extra="forbid", validate_assignment=True)

    arch: Literal["llama", "qwen3"] = "llama"
    hidden_size: int = pydantic.Field(128, gt=0)
    intermediate_size: int = pydantic.Field(344, gt=0)
    num_layers: int = pydantic.Field(4, gt=0)
    num_heads: int = pydantic.Field(4, gt=0)
    num_kv_heads: int = pydantic.Field(2, gt=0)
    head_dim: int | None = pydantic.Field(None, gt=0)
    vocab_size: int = pydantic.Field(4096, ge=2)
    max_seq_len: int = pydantic.Field(256, gt=0)
    tie_embeddings: bool = True
    rope_theta: float = pydantic.Field(10000.0, gt=0)

    @pydantic.model_validator(mode="after")
    def _check_heads(self) -> "ModelConfig":
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

    @property
    def resolved_head_dim(self) -> int:
        """Per-head width actually used: ``head_dim`` or ``hidden_size // num_heads``."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads
