"""Spawn the ranks of a test's process group and wait for them (tests only)."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Sequence


def run_ranks(target: Callable[..., None], args: Sequence[tuple], timeout_s: float = 90.0) -> None:
    """Run ``target(*args[r])`` in one spawned process per rank r; assert each exits 0 within
    ``timeout_s`` seconds (each join), and kill whichever is still alive afterwards."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=a) for a in args]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout_s)
        assert [p.exitcode for p in procs] == [0] * len(procs)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
