"""Scaled-down LLaMA / Qwen3 causal language models and their per-layer parameter table.

Source: §13 of the seed (Real and Emu-S train LLaMA3.2-1B, Emu-L trains Qwen3-14B); here the same
HF ``transformers`` architectures (``LlamaForCausalLM``, ``Qwen3ForCausalLM``) are built from
small configs (≈ 1.3 M parameters by default) so that a CPU can run several clusters.  The
per-layer table (:mod:`dips.roles.layers`) is the unit that stage workers own and that the PS
shards across followers (§5, §10).  No weights are ever downloaded: models are built from a
config and a seed, or (issue 14, ``model: {pretrained: PATH}``) loaded from a local directory
with ``from_pretrained(PATH, local_files_only=True)``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dips.roles.layers import layer_namer, layer_of, layer_table
from dips.spec import ModelConfig
from dips.spec.fingerprint import Fingerprint, ModelFacts

__all__ = ["build_model", "check_built", "fingerprint_of", "layer_namer", "layer_of", "layer_table",
           "model_facts", "param_count"]

def _hf_config(cfg: ModelConfig):
    """The ``transformers`` config (``LlamaConfig`` / ``Qwen3Config``) for ``cfg``; FP32, SDPA."""
    from transformers import LlamaConfig, Qwen3Config  # heavy import (5–9 s), deferred

    kwargs = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.resolved_head_dim,
        max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        hidden_act="silu",
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        attention_bias=False,
        attention_dropout=0.0,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=0,  # "<|endoftext|>" is id 0 in dips.train.corpus tokenizers
        pad_token_id=None,
        dtype=torch.float32,
        attn_implementation="sdpa",
    )
    if cfg.arch == "llama":
        return LlamaConfig(**kwargs)
    return Qwen3Config(use_sliding_window=False, **kwargs)


def build_model(cfg: ModelConfig, seed: int):
    """Build a freshly initialised FP32 ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` from ``cfg``,
    or with ``arch: hf`` any ``AutoModelForCausalLM`` of ``cfg.hf_config`` (issue 14: GPT-2,
    GPT-NeoX, ...; its vocabulary set to ``cfg.vocab_size``).

    With ``cfg.pretrained`` (a local directory written by ``save_pretrained``) the model is
    ``AutoModelForCausalLM.from_pretrained`` of it, offline, in FP32: its weights, not ``seed``,
    are version 0 of the global model, so every process that builds it gets the same θ.

    Initialisation is the library's own (normal std 0.02 for matrices, ones for RMSNorm) under
    ``torch.manual_seed(seed)`` inside ``torch.random.fork_rng``, so every process gets
    bit-identical weights for the same ``(cfg, seed)`` and the caller's global RNG state is
    left untouched.  Attention uses PyTorch SDPA; the KV cache is off; the model is returned
    in train mode on the CPU.  Source: HF transformers 5.x model classes; §13 architectures.

    Args:
        cfg: a :class:`ModelConfig` (a dict is accepted and validated).
        seed: int in [0, 2**63).

    Returns:
        ``transformers.PreTrainedModel``; ``param_count`` ≈ 1.25 M for the defaults.

    Raises:
        ValueError: ``cfg`` invalid (pydantic.ValidationError), an ``hf_config`` transformers
            refuses, ``seed`` not a non-negative int, a ``pretrained`` directory that cannot be
            loaded, or whose vocabulary (embedding rows) differs from ``cfg.vocab_size``
            (naming both).
    """
    if not isinstance(cfg, ModelConfig):
        cfg = ModelConfig.model_validate(cfg)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM, Qwen3ForCausalLM

    if cfg.pretrained is not None:
        return _load_pretrained(cfg)
    if cfg.arch == "hf":
        options = dict(cfg.hf_config or {})
        kind = options.pop("model_type")
        try:
            hf_cfg = AutoConfig.for_model(kind, **options)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"model.hf_config (model_type {kind!r}): {exc}") from None
        hf_cfg.vocab_size = cfg.vocab_size  # the run's tokenizer decides the vocabulary
        hf_cfg.use_cache = False
        build = lambda: AutoModelForCausalLM.from_config(  # noqa: E731
            hf_cfg, dtype=torch.float32, attn_implementation="sdpa")
    else:
        cls = LlamaForCausalLM if cfg.arch == "llama" else Qwen3ForCausalLM
        hf_cfg = _hf_config(cfg)
        build = lambda: cls(hf_cfg)  # noqa: E731
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    model = model.to(dtype=torch.float32)
    model.train()
    return model


def _load_pretrained(cfg: ModelConfig):
    """``AutoModelForCausalLM.from_pretrained(cfg.pretrained)``, offline, FP32, SDPA, train
    mode, KV cache off; its vocabulary checked against ``cfg.vocab_size``."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # role logs: one line per event, no progress bars
    path = Path(cfg.pretrained).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"model.pretrained = {str(cfg.pretrained)!r}: no config.json there "
                         "(a directory written by save_pretrained, present on this host)")
    try:
        hf_cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"model.pretrained = {str(cfg.pretrained)!r}: {exc}") from None
    vocab = getattr(hf_cfg, "vocab_size", None)
    if vocab != cfg.vocab_size:
        raise ValueError(f"model.vocab_size = {cfg.vocab_size} differs from the pretrained "
                         f"model's vocab_size = {vocab} ({path / 'config.json'})")
    hf_cfg.use_cache = False
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, config=hf_cfg, dtype=torch.float32, attn_implementation="sdpa",
            local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model.pretrained = {str(cfg.pretrained)!r}: {exc}") from None
    rows = model.get_input_embeddings().weight.shape[0]
    if rows != cfg.vocab_size:
        raise ValueError(f"model.vocab_size = {cfg.vocab_size} differs from the pretrained "
                         f"model's {rows} embedding rows ({path})")
    model = model.to(dtype=torch.float32)
    model.train()
    return model


def check_built(model: torch.nn.Module, seq_len: int, followers: int,
                pattern: str | None = None) -> list[tuple[str, list[str], int]]:
    """The layer table of a built ``model`` (:func:`layer_table` under ``pattern``), after the
    checks :func:`dips.spec.training.check_training` cannot make without building it (an
    ``arch: hf`` model): a training sequence of ``seq_len`` tokens fits its context
    (``max_position_embeddings`` where the config has one) and it has at least ``followers``
    layers to shard (§5).

    Raises:
        ValueError: naming the field and both values, or from :func:`layer_namer`.
    """
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(context, int) and seq_len > context:
        raise ValueError(f"inner.seq_len = {seq_len} exceeds the model's context "
                         f"(max_position_embeddings = {context})")
    table = layer_table(model, layer_namer(model, pattern))
    if followers > len(table):
        raise ValueError(f"followers = {followers} exceeds the {len(table)} layers to shard")
    return table


def param_count(model: torch.nn.Module) -> int:
    """Number of distinct parameters (scalars; tied weights counted once) of ``model``."""
    return sum(p.numel() for p in model.parameters())


def model_facts(model: torch.nn.Module, cfg: ModelConfig,
                table: list[tuple[str, list[str], int]]) -> ModelFacts:
    """What ``model`` (built from ``cfg`` by :func:`build_model`) is, for ``run.json``:
    its class, its transformers config's ``model_type``, ``hidden_size`` and
    ``max_position_embeddings`` (read through the config, so GPT-2's ``n_embd`` counts; None
    where it has none), its decoder blocks (the ``layers.*`` of its layer ``table``,
    :func:`check_built`), embedding rows and parameters (:func:`param_count`)."""
    config = getattr(model, "config", None)

    def sized(key: str) -> int | None:
        value = getattr(config, key, None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    return ModelFacts(
        architecture=type(model).__name__,
        model_type=getattr(config, "model_type", None) or None,
        pretrained=str(cfg.pretrained) if cfg.pretrained is not None else None,
        hidden_size=sized("hidden_size"),
        num_layers=sum(1 for key, _, _ in table if key.startswith("layers.")),
        vocab_size=int(model.get_input_embeddings().weight.shape[0]),
        max_position_embeddings=sized("max_position_embeddings"),
        params=param_count(model))


def fingerprint_of(model: torch.nn.Module, vocab: dict[str, int]) -> Fingerprint:
    """The :class:`dips.spec.fingerprint.Fingerprint` of a ``transformers`` model (its
    ``config``'s architecture keys, its parameters in order) and a tokenizer ``vocab``
    (``tokenizers.Tokenizer.get_vocab()``: token -> id)."""
    import hashlib
    import json

    from dips.spec.fingerprint import architecture_of

    config = model.config.to_dict() if hasattr(model, "config") else {}
    pairs = json.dumps(sorted(vocab.items()), separators=(",", ":")).encode()
    return Fingerprint(architecture=json.loads(json.dumps(architecture_of(config))),
                       vocab_sha256=hashlib.sha256(pairs).hexdigest(),
                       tensors=[(n, list(p.shape), str(p.dtype).removeprefix("torch."))
                                for n, p in model.named_parameters()])
