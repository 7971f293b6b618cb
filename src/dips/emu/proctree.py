"""The processes of one job and how a signal reaches all of them (issue 14, §12 fault injection).

A child of ``dips launch`` leads its own session, so ``killpg`` reaches it and whatever stayed
in its process group. A torchrun job does not: torchrun starts every rank in a session of its
own (review 32: a fault plan's ``stop`` of a torchrun cluster stopped its agent only, and the
ranks trained on). :func:`job_pids` therefore walks the process tree (``/proc``: every thread's
``children``) and :func:`signal_job` signals each process found, the ranks' own groups too.
Only processes started by the one given, by pid; never a name.
"""

from __future__ import annotations

import os
from pathlib import Path


def children(pid: int) -> list[int]:
    """Pids of the children of process ``pid`` ([] once it is gone, or without /proc)."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return out


def job_pids(root: int) -> list[int]:
    """``root`` and every process below it (children first found, breadth first), from
    ``/proc``; ``[root]`` where the tree cannot be read. A process reparented after its parent
    died is no longer found: collect the pids before killing the parent."""
    seen, queue = [root], [root]
    while queue:
        for child in children(queue.pop(0)):
            if child not in seen:
                seen.append(child)
                queue.append(child)
    return seen


def signal_job(root: int, sig: int, pids: list[int] | None = None) -> list[int]:
    """Send ``sig`` to the process group of ``root`` (its session) and to each process of
    ``pids`` (default :func:`job_pids` of ``root``, taken before anything is signalled) and
    its group when it leads one (a torchrun rank's own session, with its children). Gone
    processes are skipped. Returns the pids signalled."""
    pids = job_pids(root) if pids is None else pids
    done = []
    for pid in pids:
        try:
            if pid == root or os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
            done.append(pid)
        except (ProcessLookupError, PermissionError):
            continue
    return done

