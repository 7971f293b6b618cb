"""Layers: the unit that stage workers own and followers shard (§5, §10 of the seed).

A model's parameters are grouped into layers by their names: for the HF LLaMA / Qwen3 models of
:func:`dips.train.model.build_model`, ``model.embed_tokens.*`` is ``"embed"``,
``model.layers.{i}.*`` is ``"layers.{i}"`` and ``model.norm.*`` / ``lm_head.*`` are ``"head"``.
Another model passes its own ``layer_of`` (parameter name -> layer key) to the cluster API.
"""

from __future__ import annotations

import re
from typing import Callable

import torch

__all__ = ["group_layers", "layer_of", "layer_table"]

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def layer_of(param_name: str) -> str:
    """Layer key of a parameter (or state-dict) name of a model from :func:`build_model`.

    ``model.embed_tokens.*`` → ``"embed"``; ``model.layers.{i}.*`` → ``"layers.{i}"`` (plain
    int, no padding); ``model.norm.*`` and ``lm_head.*`` → ``"head"``.

    Raises:
        ValueError: any other name (the message names ``param_name`` and its value).
    """
    if not isinstance(param_name, str):
        raise ValueError(f"param_name must be a str, got {param_name!r}")
    if param_name.startswith("model.embed_tokens."):
        return "embed"
    match = _LAYER_RE.match(param_name)
    if match:
        return f"layers.{int(match.group(1))}"
    if param_name.startswith(("model.norm.", "lm_head.")):
        return "head"
    raise ValueError(f"param_name {param_name!r} belongs to no known layer (embed, layers.i, head)")


def _layer_rank(key: str) -> tuple[int, int]:
    if key == "embed":
        return (0, 0)
    if key == "head":
        return (2, 0)
    return (1, int(key.split(".", 1)[1]))


def layer_table(model: torch.nn.Module) -> list[tuple[str, list[str], int]]:
    """Per-layer parameter table: ``[(layer key, [param names], FP32 bytes), ...]``.

    Layers come in model order ``embed, layers.0 … layers.{L-1}, head``; names inside a layer
    keep ``named_parameters()`` order.  Every parameter appears exactly once: tied weights are
    listed once, under their first name (with tied embeddings the shared matrix is
    ``model.embed_tokens.weight`` in ``"embed"`` and ``"head"`` holds only ``model.norm.weight``).
    Bytes are ``4 * numel`` whatever the tensor's current dtype (the PS keeps FP32, §12).

    Raises:
        ValueError: a parameter name unknown to :func:`layer_of`.
    """
    groups: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    for name, param in model.named_parameters():  # remove_duplicate=True drops tied aliases
        key = layer_of(name)
        groups.setdefault(key, []).append(name)
        sizes[key] = sizes.get(key, 0) + 4 * param.numel()
    return [(key, groups[key], sizes[key]) for key in sorted(groups, key=_layer_rank)]


def group_layers(model: torch.nn.Module, layer_of: Callable[[str], str] = layer_of
                 ) -> list[tuple[str, list[tuple[str, torch.nn.Parameter]]]]:
    """Model-order layers: ``[(layer key, [(param name, parameter), ...]), ...]``.

    Raises ValueError if a layer's parameters are not contiguous in ``named_parameters``.
    """
    out: list[tuple[str, list[tuple[str, torch.nn.Parameter]]]] = []
    for name, p in model.named_parameters():
        key = layer_of(name)
        if out and out[-1][0] == key:
            out[-1][1].append((name, p))
        elif any(k == key for k, _ in out):
            raise ValueError(f"parameter {name!r}: layer {key!r} is not contiguous")
        else:
            out.append((key, [(name, p)]))
    return out
