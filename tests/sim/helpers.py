"""A small simulation scenario for the tests of dips.sim (seconds of simulated time, not hours)."""

from __future__ import annotations

from typing import Any

from dips.spec.simulate import SimScenario


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """``a`` updated in depth with ``b`` (nested dicts merged, anything else replaced)."""
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(a.get(k), dict):
            merge(a[k], v)
        else:
            a[k] = v
    return a


def small(**overrides: Any) -> SimScenario:
    """Three cluster types (4 clusters), 3 followers, the default 1.25M-parameter model,
    rounds of about 20 s, 2,000 simulated seconds; ``overrides`` merged in depth."""
    doc: dict[str, Any] = {
        "name": "small", "seed": 3, "model": {}, "H": 8,
        "penalty": {"warmup": 2},
        "leader": {"grace": {"window_s": 2.0}, "membership": {"heartbeat_interval_s": 1.0}},
        "followers": {"count": 3, "nic_bps": 4.0e8, "update_s_per_param": 1.0e-6},
        "clusters": [
            {"id": "a", "count": 2, "stages": 2, "step_s": 2.0, "step_cv": 0.05,
             "windows_per_step": 8, "uplink": {"bps": 1.0e8}, "latency_s": 0.01},
            {"id": "b", "stages": 3, "step_s": 2.5, "slowdown": 1.2, "windows_per_step": 8,
             "uplink": {"bps": 2.0e8, "schedule": [{"at_s": 500, "bps": 5.0e7}]},
             "downlink": {"bps": 3.0e8}},
            {"id": "c", "stages": 1, "step_s": 3.0, "windows_per_step": 4,
             "transient": [{"start_s": 100, "end_s": 400, "factor": 2.0}],
             "uplink": {"bps": 1.0e8}, "shared_links": True, "join_s": 30}],
        "norms": {"anomaly_prob": 0.1},
        "data": {"tokens_per_window": 129, "num_chunks": 64, "windows_per_chunk": 40},
        "horizon_s": 2000, "timeline_s": 600}
    return SimScenario.model_validate(merge(doc, overrides))
