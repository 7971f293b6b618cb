"""Baselines in virtual time (dips.baselines.virtual_sync / virtual_async): each trains a tiny
model and its validation loss falls; their clocks are hand-checked; async runs are reproducible."""

from __future__ import annotations

from pathlib import Path

import pytest

from dips.bench.runners import get_runner
from tests.emu.vt_helpers import ROOT, TOKENS_PER_STEP, one_second_scale, tiny

pytestmark = pytest.mark.timeout(120)
CACHE = ROOT / ".cache" / "dips"
TINY_PARAMS = 34976


@pytest.mark.parametrize("method", ["dp", "diloco", "async-diloco"])
def test_baseline_trains_and_loss_falls(tmp_path: Path, method: str) -> None:
    s = tiny(CACHE)
    r = get_runner("virtual", method)(s, tmp_path)
    assert r.method == method and r.mode == "virtual"
    assert r.tokens >= s.token_budget and r.time_s > 0
    assert r.final_eval_loss < r.curve[0].eval_loss - 0.5
    losses = [p.eval_loss for p in r.curve]
    assert min(losses[1:]) < losses[0]
    assert r.updates_rejected == 0 and r.tokens_accepted == r.tokens  # nothing is ever refused


def _two_clusters(**over):
    # Slowdowns 1 and 2, H = 2 steps of 1 s; one transfer = 1 s on a 10 Gbit link.
    return tiny(CACHE, clusters=[{"id": "a"}, {"id": "b", "slowdown": 2.0}], inner={"H": 2},
                timing={"step_s": 1.0, "model_bytes_scale": one_second_scale(TINY_PARAMS)},
                **over)


def test_diloco_round_is_slowest_cluster_plus_allreduce(tmp_path: Path) -> None:
    # A round: b's 2 steps of 2 s (a waits 2 s), then a 2-way ring all-reduce: each link
    # carries 2(N-1)/N = 1 model = 1 s. 3 rounds: 3 x (4 + 1) = 15 s.
    s = _two_clusters(token_budget=3 * 2 * 2 * TOKENS_PER_STEP)
    r = get_runner("virtual", "diloco")(s, tmp_path)
    assert r.time_s == pytest.approx(15.0, abs=1e-9)
    assert r.comm_s == pytest.approx(2 * 3 * 1.0, abs=1e-9)
    assert r.updates_pushed == r.updates_accepted == 6 and r.extra["rounds"] == 3
    assert r.extra["clusters"]["a"]["idle_s"] == pytest.approx(3 * (2 + 1), abs=1e-9)


def test_dp_step_is_slowest_cluster_plus_gradient_allreduce(tmp_path: Path) -> None:
    # Every step: max(1 s, 2 s) of compute + 1 s all-reduce; 5 steps of both clusters.
    s = _two_clusters(token_budget=5 * 2 * TOKENS_PER_STEP)
    r = get_runner("virtual", "dp")(s, tmp_path)
    assert r.time_s == pytest.approx(15.0, abs=1e-9)
    assert r.updates_pushed == 0 and r.tokens == 5 * 2 * TOKENS_PER_STEP


def test_async_diloco_mixes_peer_updates_and_is_reproducible(tmp_path: Path) -> None:
    s = _two_clusters(token_budget=12 * 2 * 2 * TOKENS_PER_STEP)
    a = get_runner("virtual", "async-diloco")(s, tmp_path / "a")
    b = get_runner("virtual", "async-diloco")(s, tmp_path / "b")
    assert [(p.time_s, p.eval_loss) for p in a.curve] == [(p.time_s, p.eval_loss) for p in b.curve]
    # No barrier: a's round is 2 s + 1 s send, b's 4 s + 1 s: a makes ~5/3 as many outer steps.
    steps = {cid: c["outer_steps"] for cid, c in a.extra["clusters"].items()}
    assert steps["b"] >= 1 and abs(steps["a"] / steps["b"] - 5 / 3) < 0.25
    # Some of a's outer steps averaged b's pseudo-gradient with its own.
    assert 1.0 < a.extra["mean_mixed"] <= 2.0
    # Each outer step followed one send of the model to the one peer: 1 s at 10 Gbit.
    assert a.comm_s == pytest.approx(float(steps["a"] + steps["b"]), abs=1e-9)
