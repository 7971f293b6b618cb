"""Scenario → real-time run mapping (dips.bench.real) and shaping choice; no processes
(``auto`` probes with one throw-away namespace as root)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dips.baselines.real_launch import resolve_shaping
from dips.bench.real import (
    _params,
    dips_link_bps,
    dips_run_config,
    link_rate_bps,
    worker_spec,
)
from dips.bench.runners import get_runner
from dips.emu import netns
from dips.spec import METHODS, Scenario, load_scenario

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    s = load_scenario(ROOT / "configs/compare/tiny.yaml").model_dump()
    s["clusters"] = [
        {"id": "a", "slowdown": 1.0, "link": {"bps": 1e10},
         "transient": [{"start_s": 20.0, "end_s": 40.0, "factor": 2.0}]},
        {"id": "b", "slowdown": 2.0, "link": {"bps": 1e10, "schedule": [{"at_s": 100.0, "bps": 1e9}]}}]
    s.update(eta=None, n_clusters=None, mode="real", real={"time_scale": 0.1})
    return Scenario.model_validate(s)


def test_worker_spec_keeps_the_transfer_over_step_ratio(scenario):
    spec = worker_spec(scenario, "diloco")
    n = spec.payload_bytes // 2  # default payload: the model's own BF16 size
    assert spec.step_s == pytest.approx(scenario.timing.step_s * 0.1)
    a, b = spec.clusters
    real_transfer_s = spec.payload_bytes * 8 / a.link.bps
    emulated_transfer_s = scenario.transfer_bytes(n) * 8 / 10e9
    assert real_transfer_s == pytest.approx(emulated_transfer_s * 0.1)
    assert real_transfer_s / (scenario.inner.H * spec.step_s) == pytest.approx(
        scenario.transfer_over_round(n, 1e10))
    assert a.transient_tuples() == [(2.0, 4.0, 2.0)]
    assert [(c.at_s, c.bps) for c in b.link.schedule] == [
        (pytest.approx(10.0), pytest.approx(link_rate_bps(scenario, 1e9, n)))]
    assert b.link.schedule[0].bps == pytest.approx(a.link.bps / 10)
    assert spec.outer == scenario.outer
    assert spec.token_budget == scenario.token_budget and spec.data.cache_dir.is_absolute()


def test_measured_step_and_payload_padding(scenario):
    s = scenario.model_copy(update={"real": scenario.real.model_copy(
        update={"measured_step": True, "payload_bytes": 1 << 20})})
    spec = worker_spec(s, "dp")
    assert spec.step_s is None and spec.payload_bytes == 1 << 20
    # A bigger payload needs a proportionally faster link for the same transfer time.
    assert spec.clusters[0].link.bps == pytest.approx(
        worker_spec(scenario, "dp").clusters[0].link.bps * (1 << 20) / worker_spec(scenario, "dp").payload_bytes)


def test_dips_ablations(scenario):
    base = dips_run_config(scenario, "di-ps")
    assert base.penalty.enabled and not base.outer.uniform_weights and base.outer.max_norm == 1.0
    assert base.grace.window_s == pytest.approx(scenario.grace.window_s * 0.1)
    assert base.grace.max_s == pytest.approx(scenario.grace.max_s * 0.1)
    assert not base.grace.pull_barrier and dips_run_config(scenario, "di-ps-pull-barrier").grace.pull_barrier
    assert [c.slowdown for c in base.clusters] == [1.0, 2.0]
    assert not dips_run_config(scenario, "di-ps-no-penalty").penalty.enabled
    assert dips_run_config(scenario, "di-ps-uniform").outer.uniform_weights
    assert dips_run_config(scenario, "di-ps-no-clip").outer.max_norm is None
    assert dips_run_config(scenario, "di-ps-no-grace").grace.window_s == 0.0


def test_every_method_has_a_real_time_runner():
    for method in METHODS:
        assert callable(get_runner("real", method))


def test_shaping_choice():
    assert resolve_shaping("token-bucket", True)[0] == "token-bucket"
    assert resolve_shaping("none", True)[0] == "none"
    assert resolve_shaping("auto", False)[0] == "none"
    assert resolve_shaping("auto", True)[0] == netns.probe().shaping
    with pytest.raises(ValueError, match="shaping"):
        resolve_shaping("netem", True)


def test_dips_run_config_follows_shaping_and_bandwidth_schedule(scenario):
    """Di-PS real time: the shaping choice picks network netns (tc tbf) or loopback + token
    bucket; rate schedules become clusters[].link.schedule, times × time_scale."""
    n = _params(scenario)
    ten = dips_link_bps(scenario, 1e10, n)
    # Di-PS moves the real BF16 model: 2n bytes take the emulated transfer time × time_scale.
    assert 2 * n * 8 / ten == pytest.approx(scenario.transfer_bytes(n) * 8 / 10e9 * 0.1)
    kernel = dips_run_config(scenario, "di-ps", "tc-tbf")
    bucket = dips_run_config(scenario, "di-ps", "token-bucket")
    assert kernel.network == "netns" and bucket.network == "loopback"
    for cfg in (kernel, bucket):
        a, b = cfg.clusters
        assert a.link.bps == b.link.bps == pytest.approx(ten) and a.link.schedule == []
        assert [(c.at_s, c.bps) for c in b.link.schedule] == [
            (pytest.approx(10.0), pytest.approx(ten / 10))]
        assert b.link.rate_at(9.9) == pytest.approx(ten)
        assert b.link.rate_at(10.0) == pytest.approx(ten / 10)
        assert a.transient_tuples() == [(2.0, 4.0, 2.0)]
    unshaped = dips_run_config(scenario, "di-ps", "none")
    assert unshaped.network == "loopback"
    assert all(c.link is None for c in unshaped.clusters)
    # Without an explicit choice the scenario's real.shaping is resolved as for the baselines.
    for requested, network in (("token-bucket", "loopback"), ("none", "loopback"),
                               ("auto", "netns" if netns.probe().shaping == "tc-tbf" else "loopback")):
        s = scenario.model_copy(update={"real": scenario.real.model_copy(update={"shaping": requested})})
        assert dips_run_config(s, "di-ps-uniform").network == network, requested
    with pytest.raises(ValueError, match="shaping"):
        dips_run_config(scenario, "di-ps", "netem")


def test_dips_run_config_refuses_a_link_too_slow_for_tbf(scenario):
    data = scenario.model_dump()
    data["clusters"][1]["link"]["schedule"] = [{"at_s": 1.0, "bps": 1.0}]
    with pytest.raises(ValueError, match="cluster 'b': link.schedule scales to"):
        dips_run_config(Scenario.model_validate(data), "di-ps", "tc-tbf")
