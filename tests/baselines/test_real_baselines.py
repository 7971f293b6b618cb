"""Real-time baselines as real processes (dips.baselines.real_*): each trains a tiny model for a
few steps and its loss falls; every child the launcher started is gone afterwards (§4, §13).

Loopback runs need nothing special; the shaped run needs root and network namespaces (skipped
otherwise, with the reason) and checks that its namespaces are removed.

What a run trained is checked only on runs that stop at the token budget (an event);
``max_time_s`` is a safety limit there. The run that stops at ``max_time_s`` checks only the
stop itself: how much it trained by then depends on the machine's load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dips.baselines.real_launch import launch_baseline
from dips.emu import netns
from dips.spec import (ClusterConfig, DataConfig, InnerConfig, LinkConfig, ModelConfig, RateChange,
                       Transient, WorkerSpec)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
TPB = 4 * 32  # tokens per inner step


def _spec(method: str, **kw) -> WorkerSpec:
    base = dict(
        method=method, seed=0,
        model=ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, vocab_size=512, max_seq_len=64),
        data=DataConfig(vocab_size=512, num_chunks=24, cache_dir=(ROOT / ".cache/dips")),
        inner=InnerConfig(H=4, batch_size=4, seq_len=32, lr=0.003),
        token_budget=2 * 4 * TPB * 8, max_time_s=180, step_s=0.02, payload_bytes=256 * 1024,
        clusters=[ClusterConfig(id="a", slowdown=1.0, link=LinkConfig(bps=40e6)),
                  ClusterConfig(id="b", slowdown=1.5, link=LinkConfig(bps=40e6),
                                transient=[Transient(start_s=0.1, end_s=0.3, factor=2.0)])],
        eval_every_tokens=2 * 4 * TPB * 4, eval_batches=2, eval_batch_size=8,
        startup_s=180, collective_s=60)
    base.update(kw)
    return WorkerSpec(**base)


def _pids(run_dir: Path) -> list[int]:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e["pid"] for e in events if e["event"] == "start"]


def _assert_trained_and_all_gone(res, run_dir: Path) -> None:
    assert res.final_eval_loss < res.curve[0].eval_loss - 0.05, res.curve
    assert res.extra["train_loss_last"] < res.extra["train_loss_first"] - 0.1
    _assert_all_gone(res, run_dir)


def _assert_all_gone(res, run_dir: Path) -> None:
    assert res.extra["diverged"] == []
    assert set(res.extra["exit_codes"].values()) == {0}, res.extra["exit_codes"]
    pids = _pids(run_dir)
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("method", [
    "dp", pytest.param("diloco", marks=pytest.mark.long)])  # make test-long
def test_synchronous_baseline_trains_on_loopback(method, tmp_path):
    res = launch_baseline(_spec(method), tmp_path, shaping="none")
    _assert_trained_and_all_gone(res, tmp_path)
    assert res.shaping == "none" and res.mode == "real" and res.method == method
    assert res.tokens == res.tokens_accepted == 2 * 4 * TPB * 8  # both stop on the same step
    assert res.comm_s > 0 and res.extra["wait_s"] > 0  # b (×1.5) keeps a waiting at the barrier
    assert res.updates_pushed == (0 if method == "dp" else 2 * 8)
    assert [p.tokens for p in res.curve] == [0, 1024 * 4, 1024 * 8]


def test_async_diloco_trains_on_loopback(tmp_path):
    """Naive async DiLoCo through the clusters' token buckets, to the token budget: 64 inner
    steps of H = 4 in all, so each cluster pushed several times (however fast each ran)."""
    spec = _spec("async-diloco", payload_bytes=0)
    res = launch_baseline(spec, tmp_path, shaping="token-bucket")
    _assert_trained_and_all_gone(res, tmp_path)
    assert res.shaping == "token-bucket" and res.extra["stop_reason"] == "token budget"
    assert res.tokens >= spec.token_budget
    assert res.updates_pushed >= 4 and res.updates_rejected == 0
    assert res.extra["mean_mixed"] >= 1.0
    assert set(res.extra["final_eval_loss_per_cluster"]) == {"a", "b"}


@pytest.mark.long  # make test-long
def test_async_diloco_stops_at_max_time(tmp_path):
    """No budget in reach: the launcher stops every process at max_time_s (SIGTERM, by pid)
    and still collects a result; how far training got by then is not judged."""
    res = launch_baseline(_spec("async-diloco", token_budget=10**9, max_time_s=3.0,
                                payload_bytes=0), tmp_path, shaping="token-bucket")
    _assert_all_gone(res, tmp_path)
    assert res.shaping == "token-bucket" and res.extra["stop_reason"] == "max time"
    assert res.tokens < 10**9 and res.updates_rejected == 0
    assert res.curve and res.curve[0].tokens == 0


_CAP = netns.probe()


@pytest.mark.long  # make test-long
@pytest.mark.skipif(_CAP.shaping != "tc-tbf", reason=f"kernel shaping unavailable: {_CAP.reason}")
def test_async_diloco_over_shaped_namespaces(tmp_path):
    """Each cluster in its own namespace behind a tbf'd veth; b's link drops mid-run."""
    spec = _spec("async-diloco")
    spec.clusters[1].link = LinkConfig(bps=40e6, schedule=[RateChange(at_s=0.5, bps=10e6)])
    res = launch_baseline(spec, tmp_path, shaping="tc-tbf")
    _assert_trained_and_all_gone(res, tmp_path)
    assert res.shaping == "tc-tbf" and res.extra["stop_reason"] == "token budget"
    assert res.tokens >= spec.token_budget and res.comm_s > 0
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    prefix = next(e["prefix"] for e in events if e["event"] == "shaping")
    assert any(e["event"] == "rate" and e["cluster"] == "b" for e in events)
    assert netns.list_namespaces(prefix) == []
