"""Registry of comparison runners, keyed by (time mode, method) (seed §4, §13–§15).

A runner trains one method on one scenario and returns a :class:`~dips.bench.result.MethodResult`::

    @register("virtual", "di-ps")
    def run_dips_virtual(scenario: Scenario, out_dir: Path) -> MethodResult: ...

``out_dir`` is a directory the runner may write into (per-method logs); it exists on entry.
Virtual-time runners live in :mod:`dips.emu.virtual` (Di-PS and its ablations),
:mod:`dips.baselines.virtual_sync` (data parallel, DiLoCo) and :mod:`dips.baselines.virtual_async`;
real-time ones in :mod:`dips.bench.real`.  Both are imported lazily by :func:`get_runner`, so importing this
module stays cheap.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable

from dips.bench.result import MethodResult
from dips.bench.scenario import METHODS, Scenario

__all__ = ["RUNNERS", "Runner", "get_runner", "register"]

Runner = Callable[[Scenario, Path], MethodResult]
RUNNERS: dict[tuple[str, str], Runner] = {}

# Modules that register runners for each mode (imported on first use).
_PROVIDERS: dict[str, tuple[str, ...]] = {
    "virtual": ("dips.emu.virtual", "dips.baselines.virtual_sync", "dips.baselines.virtual_async"),
    "real": ("dips.bench.real",),
}


def register(mode: str, method: str) -> Callable[[Runner], Runner]:
    """Decorator adding ``fn`` as the runner of ``(mode, method)``.

    Raises:
        ValueError: unknown mode or method, or the pair already registered.
    """
    if mode not in _PROVIDERS:
        raise ValueError(f"mode = {mode!r} must be one of {sorted(_PROVIDERS)}")
    if method not in METHODS:
        raise ValueError(f"method = {method!r} must be one of {list(METHODS)}")

    def deco(fn: Runner) -> Runner:
        if (mode, method) in RUNNERS and RUNNERS[(mode, method)] is not fn:
            raise ValueError(f"runner for mode = {mode!r}, method = {method!r} already registered")
        RUNNERS[(mode, method)] = fn
        return fn

    return deco


def get_runner(mode: str, method: str) -> Runner:
    """The runner of ``(mode, method)``, importing its provider module on first use.

    Raises:
        ValueError: unknown mode or method; or no runner registered for the pair.
        RuntimeError: the provider module for ``mode`` is not installed (real time not built).
    """
    if mode not in _PROVIDERS:
        raise ValueError(f"mode = {mode!r} must be one of {sorted(_PROVIDERS)}")
    if method not in METHODS:
        raise ValueError(f"method = {method!r} must be one of {list(METHODS)}")
    if (mode, method) not in RUNNERS:
        for module in _PROVIDERS[mode]:
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if exc.name != module:
                    raise
                raise RuntimeError(f"mode = {mode!r}: its runners ({module}) are not available "
                                   f"in this installation") from exc
    try:
        return RUNNERS[(mode, method)]
    except KeyError:
        raise ValueError(f"no runner for mode = {mode!r}, method = {method!r}") from None
