"""A model's fingerprint: what must be equal for two processes to train the same model.

Shapes are not enough: a model with 8 heads / 4 KV heads / rope_theta 5e5 instead of
4 / 2 / 1e4 can have every tensor of the same shape and still compute another function. The
fingerprint holds the architecture's config (the ``transformers`` config keys that define the
function: heads, KV heads, head_dim, RoPE settings, norm eps, tied embeddings, ...), a hash
of the tokenizer's vocabulary, and the ordered parameter names, shapes and dtypes. The leader
serves the run's fingerprint; a cluster whose model differs is refused at join with
:func:`mismatch`'s description (the differing fields, or the first differing tensor).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, ValidationError

from dips.spec.base import Strict

#: ``transformers`` config keys that change what a decoder computes (others, e.g. the
#: library version or ``use_cache``, do not).
ARCH_KEYS = ("model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
             "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "max_position_embeddings", "tie_word_embeddings", "rope_parameters", "rope_theta",
             "rope_scaling", "hidden_act", "rms_norm_eps", "attention_bias", "mlp_bias",
             "use_sliding_window", "sliding_window", "partial_rotary_factor")


class Fingerprint(Strict):
    """See the module docstring. JSON round-trips exactly (:meth:`to_json`)."""

    architecture: dict[str, Any] = Field(description="the config keys of ARCH_KEYS present")
    vocab_sha256: str = Field(description="SHA-256 of the tokenizer's sorted (token, id) pairs")
    tensors: list[tuple[str, list[int], str]] = Field(
        description="parameters in model order: (name, shape, dtype)")

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def architecture_of(config: dict[str, Any]) -> dict[str, Any]:
    """The fingerprinted part of a ``transformers`` config dict (``config.to_dict()``)."""
    return {k: config[k] for k in ARCH_KEYS if k in config}


def mismatch(expected: str, got: str) -> str:
    """"" when fingerprint JSONs ``expected`` and ``got`` agree, else a one-line description
    naming the differing architecture fields, the vocabulary, or the first differing tensor
    (a malformed or missing ``got`` is described as such)."""
    want = Fingerprint.model_validate_json(expected)
    if not got:
        return "the join carries no model fingerprint"
    try:
        have = Fingerprint.model_validate_json(got)
    except ValidationError as exc:
        return f"malformed fingerprint ({exc.error_count()} errors: {exc.errors()[0]['msg']})"
    diffs = []
    for k in sorted(set(want.architecture) | set(have.architecture)):
        a, b = want.architecture.get(k), have.architecture.get(k)
        if a != b:
            diffs.append(f"architecture.{k}: run {a!r}, cluster {b!r}")
    if want.vocab_sha256 != have.vocab_sha256:
        diffs.append(f"tokenizer vocabulary hash: run {want.vocab_sha256[:12]}, cluster "
                     f"{have.vocab_sha256[:12]}")
    for i, (a, b) in enumerate(zip(want.tensors, have.tensors)):
        if tuple(a) != tuple(b):
            diffs.append(f"tensor #{i}: run {a[0]} {a[1]} {a[2]}, cluster {b[0]} {b[1]} {b[2]}")
            break
    else:
        if len(want.tensors) != len(have.tensors):
            diffs.append(f"tensors: run {len(want.tensors)}, cluster {len(have.tensors)}")
    return "; ".join(diffs)


class ModelFacts(Strict):
    """What the run's model is, as built (``run.json``'s ``model``): for ``model.pretrained``
    or ``model.hf_config`` the sizes come from the loaded model, not from the config's
    built-in defaults, which those architectures do not use (issue 14)."""

    architecture: str = Field(description="the model's class (e.g. LlamaForCausalLM)")
    model_type: str | None = Field(None, description="the transformers config's model_type")
    pretrained: str | None = Field(None, description="the directory it was loaded from "
                                                     "(model.pretrained; None: built)")
    hidden_size: int | None = Field(None, ge=1, description="model width (features), from "
                                                            "its config")
    num_layers: int = Field(ge=0, description="decoder blocks found in its module tree")
    vocab_size: int = Field(ge=1, description="embedding rows (tokens)")
    max_position_embeddings: int | None = Field(None, ge=1, description="context (tokens), "
                                                                        "from its config")
    params: int = Field(ge=1, description="parameters (scalars; tied weights once)")
