"""A SIGSTOPped rank ends its torchrun cluster, which re-joins when restarted (review 14 F1,
issue 14; dips.node.stepwatch under a real stop, not a fake clock).

A 2-rank DDP cluster (gloo on CPU) with ``stall_floor_s: 5`` joins a real leader and follower
and trains; its sync interval H is far longer than the test, so after its join every rank is
in its inner steps (never in a sync command, where the transfer deadlines bound a stop
instead). Once rank 0 has logged a few steps, rank 1 is stopped with SIGSTOP. Rank 0's next
inner step waits in the gradient all-reduce (or, rank 1 stopped while it paced, the per-step
collective after rank 0's step); once it has run over its bound (the floor: 20 ×
the median step is far less here) rank 0 logs why and exits, and torchrun ends the job
non-zero while the leader and the follower keep serving. Restarted as an operator would,
the cluster re-joins and trains on without a stall. Every process started is SIGCONTed and
killed by pid at the end.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import yaml

from .roles import ROOT, alive, kill_left, start_roles
from .torchrun import lines, torchrun, wait

pytestmark = [pytest.mark.integration, pytest.mark.long, pytest.mark.timeout(420)]

STALLED = "over its bound of"  # an inner step or a per-step collective


def _config(tmp: Path, slowdown: float) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["inner"]["H"] = 1_000_000  # no sync while the test runs: only inner steps
    cfg.update(clusters=[{"id": "d", "stall_floor_s": 5.0, "slowdown": slowdown}],
               max_time_s=None, followers=1)
    (tmp / "run.yaml").write_text(yaml.safe_dump(cfg))
    return tmp / "run.yaml"


def _release(pid: int | None) -> None:
    """SIGCONT then SIGKILL ``pid`` if it is still there (the stopped rank)."""
    if pid is None or not alive(pid):
        return
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return


def _steps(state: Path, join: int) -> int:
    """Inner steps rank 0 recorded after its ``join``-th join (0: the first)."""
    recs = lines(state / "train.jsonl")
    joins = [i for i, r in enumerate(recs) if r.get("event") == "join"]
    if len(joins) <= join:
        return 0
    return sum(1 for r in recs[joins[join]:] if "step" in r)


@pytest.mark.parametrize("slowdown", [1.0, 10.0])
def test_a_stopped_rank_ends_its_cluster_which_rejoins_when_restarted(tmp_path, slowdown):
    """``slowdown: 10``: nine tenths of each step's time is the pacing after it, so rank 1 is
    most likely stopped there, outside the step: rank 0 then waits in a per-step collective
    (review 24, F1), bounded as the step is."""
    leader, procs = start_roles(tmp_path, _config(tmp_path, slowdown), followers=1)
    log, state = tmp_path / "d.log", tmp_path / "d"
    stopped = None
    try:
        procs["d"] = torchrun("d", leader, state, log)
        wait("rank 0's inner steps after the warm-up", lambda: _steps(state, 0) >= 5, procs)
        stopped = int(re.search(r"rank 1 of 2 \(local rank 1, pid (\d+)\)", log.read_text())[1])
        before = len(log.read_text())
        os.kill(stopped, signal.SIGSTOP)
        assert procs.pop("d").wait(240) != 0  # rank 0 gave up on the stopped rank
        assert STALLED in log.read_text()[before:], log.read_text()[-3000:]
        assert all(p.poll() is None for p in procs.values())  # leader, follower serve on
        _release(stopped)

        procs["d"] = torchrun("d", leader, state, log)  # the operator restarts it
        wait("the restarted cluster's inner steps", lambda: _steps(state, 1) >= 10, procs)
        assert log.read_text().count(STALLED) == 1  # the restarted job ran without a stall
        procs["d"].send_signal(signal.SIGTERM)  # torchrun itself exits 1 on a SIGTERM
        procs.pop("d").wait(120)
    finally:
        _release(stopped)
        kill_left(procs)
