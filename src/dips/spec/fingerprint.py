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

import functools
import json
from typing import Any

from pydantic import Field

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


#: A member's fingerprint is read only up to this many times the run's length (plus
#: :data:`SLACK` characters): a model of up to about 4× the tensors is still described, a
#: longer document is refused by its length without being parsed (review 21, F2).
GROWTH = 4
#: Characters added to GROWTH × the run's fingerprint length.
SLACK = 4096
#: Differing architecture fields named in a description.
MAX_SHOWN = 8
#: Nesting levels a fingerprint may have (a real one: 4, a rope_scaling dict inside).
MAX_DEPTH = 8


@functools.lru_cache(maxsize=4)
def _run_fingerprint(expected: str) -> Fingerprint:
    """The run's own fingerprint, parsed once (it is the leader's, not a member's)."""
    return Fingerprint.model_validate_json(expected)


def _depth(v: Any, limit: int) -> int:
    """Nesting depth of JSON value ``v``, at most ``limit`` + 1 (it stops looking there)."""
    if limit < 0 or not isinstance(v, (dict, list)):
        return 0
    items = v.values() if isinstance(v, dict) else v
    return 1 + max((_depth(x, limit - 1) for x in items), default=0)


def _tensor_error(i: int, t: Any) -> str:
    """Why entry ``i`` of a fingerprint's ``tensors`` is not (name, shape, dtype), or ""."""
    if not isinstance(t, list) or len(t) != 3:
        return f"tensors[{i}] is not a [name, shape, dtype] triple"
    name, shape, dtype = t
    if not isinstance(name, str) or not isinstance(dtype, str):
        return f"tensors[{i}]: name and dtype must be strings"
    if not isinstance(shape, list) or not all(type(d) is int for d in shape):
        return f"tensors[{i}]: shape must be a list of integers"
    return ""


def _parse(got: str, limit: int) -> tuple[dict[str, Any] | None, str]:
    """(the member's fingerprint as JSON, "") or (None, why it is malformed), stopping at the
    first problem; the work is bounded by ``limit`` characters parsed by ``json`` (C, linear)
    and one pass over the top-level fields. Nothing of it goes through pydantic."""
    if len(got) > limit:
        return None, (f"{len(got)} characters, over the {limit} a fingerprint of this run's "
                      "model may have")
    try:
        doc = json.loads(got)
    except (ValueError, RecursionError) as exc:  # not JSON, an int of too many digits, nesting
        return None, f"not JSON ({type(exc).__name__})"
    if not isinstance(doc, dict) or set(doc) != {"architecture", "vocab_sha256", "tensors"}:
        return None, "must be an object of architecture, vocab_sha256 and tensors"
    if not isinstance(doc["architecture"], dict) or not isinstance(doc["vocab_sha256"], str) \
            or not isinstance(doc["tensors"], list):
        return None, "architecture must be an object, vocab_sha256 a string, tensors a list"
    if _depth(doc, MAX_DEPTH) > MAX_DEPTH:
        return None, f"nested deeper than {MAX_DEPTH} levels"
    return doc, ""


def mismatch(expected: str, got: str) -> str:
    """"" when fingerprint JSONs ``expected`` (the run's) and ``got`` (a member's) agree,
    else a one-line description naming the differing architecture fields, the vocabulary, or
    the first differing tensor (a malformed or missing ``got`` is described as such).

    ``got`` is network input (review 21, F2: a 1 MiB document of 500,000 wrong entries cost
    pydantic 3.5 s of the leader's GIL and 700 MB to describe): an identical string agrees at
    once (an honest member sends :meth:`Fingerprint.to_json`, as the leader does); else at
    most ``GROWTH`` × ``len(expected)`` + ``SLACK`` characters are parsed with ``json`` and
    checked by hand, stopping at the first malformed field or differing tensor, so the work
    is linear in a bounded length. Raises ValueError if ``expected`` itself is not a
    fingerprint (the run's own, never a member's)."""
    if got == expected:
        return ""
    if not got:
        return "the join carries no model fingerprint"
    want = _run_fingerprint(expected)
    have, why = _parse(got, GROWTH * len(expected) + SLACK)
    if have is None:
        return f"malformed fingerprint: {why}"
    diffs = []
    arch = have["architecture"]
    for k in sorted(set(want.architecture) | set(arch)):
        a, b = want.architecture.get(k), arch.get(k)
        if a != b and len(diffs) < MAX_SHOWN:
            name = k if k in ARCH_KEYS else repr(k[:40])
            diffs.append(f"architecture.{name}: run {a!r}, cluster {repr(b)[:80]}")
        elif a != b:
            diffs[-1] += ", ..."
            break
    if want.vocab_sha256 != have["vocab_sha256"]:
        diffs.append(f"tokenizer vocabulary hash: run {want.vocab_sha256[:12]}, cluster "
                     f"{have['vocab_sha256'][:12]!r}")
    tensors = have["tensors"]
    for i, (a, b) in enumerate(zip(want.tensors, tensors)):
        bad = _tensor_error(i, b)
        if bad:
            return f"malformed fingerprint: {bad}"
        if [a[0], list(a[1]), a[2]] != b:
            diffs.append(f"tensor #{i}: run {a[0]} {a[1]} {a[2]}, cluster {b[0][:80]!r} "
                         f"{b[1][:8]} {b[2][:16]!r}")
            break
    else:
        if len(want.tensors) != len(tensors):
            diffs.append(f"tensors: run {len(want.tensors)}, cluster {len(tensors)}")
    return "; ".join(diffs)  # "": the same fingerprint written another way


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
