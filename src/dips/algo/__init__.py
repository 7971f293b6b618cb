"""Pure math and decisions of Di-PS: penalty, aggregation, clipping, outer optimizer, grace
window, schedule, layer ownership, data ledger and reconciliation (§6, §7, §8, §10, §12).

Imports only torch, the standard library and the configuration models of :mod:`dips.spec`
(the layer below, e.g. :class:`dips.spec.PenaltyConfig`, re-exported here); no sockets,
threads, sleeps, env reads or wall clock (time is passed in as float seconds). Names are
loaded lazily from their submodules, so a process that needs no tensor math (the leader)
never imports torch.
"""

from importlib import import_module
from typing import Any

_LOCATIONS = {
    "clip_factor": "aggregate", "clip_threshold": "aggregate", "staleness_scale": "aggregate", "squared_norm": "aggregate", "token_weights": "aggregate",
    "weighted_mean": "aggregate", "robust_scale": "aggregate", "push_bound": "aggregate",
    "GraceState": "grace", "expected_cost_s": "grace", "optimal_grace_s": "grace",
    "Refusal": "refusal", "Refused": "refusal",
    "OuterConfig": "outer", "nesterov_step": "outer", "round_state_": "outer", "pseudo_gradient": "outer",
    "min_max_part_sum": "partition", "partition_contiguous": "partition",
    "PenaltyConfig": "penalty", "PenaltyState": "penalty", "Verdict": "penalty",
    "decide": "penalty", "robust_mu": "penalty",
    "best_placement": "placement", "placement_scores": "placement",
    "ScheduleBook": "schedule", "Transfer": "schedule", "greedy_schedule": "schedule",
}

__all__ = sorted(_LOCATIONS)


def __getattr__(name: str) -> Any:
    if name not in _LOCATIONS:
        raise AttributeError(f"module 'dips.algo' has no attribute {name!r}")
    value = getattr(import_module(f"dips.algo.{_LOCATIONS[name]}"), name)
    globals()[name] = value
    return value
