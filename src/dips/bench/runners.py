"""The comparison runners, keyed by (time mode, method) (seed §4, §13–§15).

A runner trains one method on one scenario and returns a :class:`dips.emu.result.MethodResult`:
``runner(scenario, out_dir) -> MethodResult``; ``out_dir`` exists on entry and may hold
per-method logs.  The table below names where each runner lives; its module is imported on
first use, so importing this one stays cheap.  The runners import nothing from this module
(layers point down: ``emu`` ← ``baselines`` ← ``bench``): virtual-time Di-PS and its ablations
are :func:`dips.emu.virtual.run_dips`, the virtual baselines are in
:mod:`dips.baselines.virtual_sync` / :mod:`dips.baselines.virtual_async`, and the real-time
runners in :mod:`dips.bench.real`.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Callable

from dips.emu.result import MethodResult
from dips.spec import Scenario
from dips.spec.scenario import METHODS

__all__ = ["MODES", "RUNNERS", "Runner", "get_runner"]

Runner = Callable[[Scenario, Path], MethodResult]
MODES = ("virtual", "real")


def _table() -> dict[tuple[str, str], tuple[str, str, bool]]:
    """(mode, method) -> (module, function, whether it takes the method as third argument)."""
    table: dict[tuple[str, str], tuple[str, str, bool]] = {
        ("virtual", "dp"): ("dips.baselines.virtual_sync", "run_dp", False),
        ("virtual", "diloco"): ("dips.baselines.virtual_sync", "run_diloco", False),
        ("virtual", "async-diloco"): ("dips.baselines.virtual_async", "run_async_diloco", False),
        ("real", "dp"): ("dips.bench.real", "run_dp_real", False),
        ("real", "diloco"): ("dips.bench.real", "run_diloco_real", False),
        ("real", "async-diloco"): ("dips.bench.real", "run_async_diloco_real", False),
    }
    for m in METHODS:
        if m.startswith("di-ps"):
            table[("virtual", m)] = ("dips.emu.virtual", "run_dips", True)
            table[("real", m)] = ("dips.bench.real", "run_dips_real", True)
    return table


#: Where every runner lives (see :func:`_table`).
RUNNERS: dict[tuple[str, str], tuple[str, str, bool]] = _table()


def get_runner(mode: str, method: str) -> Runner:
    """The runner of ``(mode, method)``, importing its module on first use.

    Raises:
        ValueError: unknown mode or method.
        RuntimeError: the runner's module is not installed (e.g. real time not built).
    """
    if mode not in MODES:
        raise ValueError(f"mode = {mode!r} must be one of {list(MODES)}")
    if method not in METHODS:
        raise ValueError(f"method = {method!r} must be one of {list(METHODS)}")
    module, name, takes_method = RUNNERS[(mode, method)]
    try:
        fn = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        raise RuntimeError(f"mode = {mode!r}: its runners ({module}) are not available in this "
                           f"installation") from exc
    return functools.partial(fn, method=method) if takes_method else fn
