"""Layers: the unit that stage workers own and followers shard (§5, §10 of the seed).

A model's parameters are grouped into layers by their names: for the HF LLaMA / Qwen3 models of
:func:`dips.train.model.build_model`, ``model.embed_tokens.*`` is ``"embed"``,
``model.layers.{i}.*`` is ``"layers.{i}"`` and ``model.norm.*`` / ``lm_head.*`` are ``"head"``.
Any other model (issue 14: GPT-2, GPT-NeoX, ... from an HF config) is named by
:func:`layer_namer`, which finds the decoder blocks in the module tree (the ``ModuleList`` of
same-class modules holding the most parameters): block i is ``"layers.{i}"``, what comes before
the blocks in ``named_parameters()`` order (embeddings) is ``"embed"``, what comes after
(final norm, head) is ``"head"``; a ``pattern`` (a regex whose group 1 is the block index)
overrides the search for unusual models. A caller may still pass its own ``layer_of``
(parameter name -> layer key) to the cluster API.
"""

from __future__ import annotations

import logging
import re
from typing import Callable

import torch

log = logging.getLogger(__name__)

__all__ = ["blocks_prefix", "group_layers", "layer_namer", "layer_of", "layer_table"]

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


def blocks_prefix(model: torch.nn.Module) -> str:
    """The module path of ``model``'s decoder blocks (e.g. ``"model.layers"``,
    ``"transformer.h"``, ``"gpt_neox.layers"``): of the ``torch.nn.ModuleList`` whose children
    are all of one class, the one with the most parameters (ties: the first in module order).

    Raises:
        ValueError: no such ``ModuleList`` with parameters (name a ``layer_pattern``).
    """
    best, most = None, 0
    for name, module in model.named_modules():
        children = list(module.children()) if isinstance(module, torch.nn.ModuleList) else []
        if not children or len({type(c) for c in children}) != 1:
            continue
        count = sum(p.numel() for p in module.parameters())
        if count > most:
            best, most = name, count
    if best is None:
        raise ValueError(f"model {type(model).__name__}: no ModuleList of decoder blocks found; "
                         "set model.layer_pattern (a regex whose group 1 is the block index)")
    return best


def _warn_other_blocks(model: torch.nn.Module, found: str) -> None:
    """Log a warning naming each other ``ModuleList`` of one class with parameters (outside
    the blocks ``found``): its parameters go to ``embed`` or ``head``, one unit each, which
    may be most of the model (review 24, F7: a model with blocks in two lists)."""
    for name, module in model.named_modules():
        if (not isinstance(module, torch.nn.ModuleList) or name == found
                or name.startswith(found + ".") or found.startswith(name + ".")):
            continue
        children = list(module.children())
        count = sum(p.numel() for p in module.parameters())
        if children and len({type(c) for c in children}) == 1 and count:
            log.warning("model %s: the ModuleList %r (%d modules, %d parameters) is not the "
                        "decoder blocks %r: its parameters go to embed or head; set "
                        "model.layer_pattern if it holds blocks too", type(model).__name__,
                        name, len(children), count, found)


def layer_namer(model: torch.nn.Module, pattern: str | None = None) -> Callable[[str], str]:
    """A ``layer_of`` for ``model`` (parameter name -> ``"embed"``, ``"layers.{i}"``,
    ``"head"``; module docstring). ``pattern``: a regex whose group 1 is the block index,
    matched at the start of a name (None: the blocks of :func:`blocks_prefix`). For the
    LLaMA / Qwen3 models of :func:`dips.train.model.build_model` it names every parameter as
    :func:`layer_of` does.

    The returned function raises ValueError for a name that is not a parameter of ``model``.

    Raises:
        ValueError: no blocks found, a pattern that does not compile or has no group 1, or
            one that matches no parameter.
    """
    if pattern is None:
        found = blocks_prefix(model)
        _warn_other_blocks(model, found)
        regex = re.compile(rf"^{re.escape(found)}\.(\d+)\.")
    else:
        try:
            regex = re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"model.layer_pattern {pattern!r} does not compile: {exc}") from None
        if regex.groups < 1:
            raise ValueError(f"model.layer_pattern {pattern!r} has no group for the block index")
    keys: dict[str, str] = {}
    seen_block = False
    block_at: dict[int, str] = {}  # index -> the module path of its first parameter
    for name, _ in model.named_parameters():
        match = regex.match(name)
        if match:
            index = int(match.group(1))
            path = name[:match.end(1)]  # the block's module path, up to its index
            first = block_at.setdefault(index, path)
            if first != path:  # two modules would share one layer key, silently
                raise ValueError(f"model.layer_pattern {pattern!r} gives index {index} to "
                                 f"two blocks, {first!r} and {path!r}: match one list of "
                                 "blocks (the others then go to embed or head)")
            keys[name] = f"layers.{index}"
            seen_block = True
        else:
            keys[name] = "head" if seen_block else "embed"
    if not seen_block:
        raise ValueError(f"model.layer_pattern '{pattern}' matches no parameter of "
                         f"{type(model).__name__}")

    def named(param_name: str) -> str:
        try:
            return keys[param_name]
        except (KeyError, TypeError):
            raise ValueError(f"param_name {param_name!r} is not a parameter of the model "
                             "(embed, layers.i, head)") from None
    return named


def layer_table(model: torch.nn.Module, layer_of: Callable[[str], str] | None = None
                ) -> list[tuple[str, list[str], int]]:
    """Per-layer parameter table: ``[(layer key, [param names], FP32 bytes), ...]``.

    Layers come in model order ``embed, layers.0 … layers.{L-1}, head``; names inside a layer
    keep ``named_parameters()`` order.  Every parameter appears exactly once: tied weights are
    listed once, under their first name (with tied embeddings the shared matrix is
    ``model.embed_tokens.weight`` in ``"embed"`` and ``"head"`` holds only ``model.norm.weight``).
    Bytes are ``4 * numel`` whatever the tensor's current dtype (the PS keeps FP32, §12).

    ``layer_of``: parameter name -> layer key (None: :func:`layer_namer` of ``model``).

    Raises:
        ValueError: a parameter name unknown to ``layer_of``, or no blocks found.
    """
    layer_of = layer_of or layer_namer(model)
    groups: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    for name, param in model.named_parameters():  # remove_duplicate=True drops tied aliases
        key = layer_of(name)
        groups.setdefault(key, []).append(name)
        sizes[key] = sizes.get(key, 0) + 4 * param.numel()
    return [(key, groups[key], sizes[key]) for key in sorted(groups, key=_layer_rank)]


def group_layers(model: torch.nn.Module, layer_of: Callable[[str], str] | None = None
                 ) -> list[tuple[str, list[tuple[str, torch.nn.Parameter]]]]:
    """Model-order layers: ``[(layer key, [(param name, parameter), ...]), ...]``
    (``layer_of`` None: :func:`layer_namer` of ``model``).

    Raises ValueError if a layer's parameters are not contiguous in ``named_parameters``.
    """
    layer_of = layer_of or layer_namer(model)
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
