"""``dips.spec``: the typed configuration of every run — one pydantic model per concept.

The bottom layer of dips (``spec`` ← ``algo`` ← ``wire`` ← ``roles`` ← ``train`` ←
``emu``/``baselines`` ← ``bench`` ← ``cli``): it imports pydantic, PyYAML and the standard
library only.  Every field carries a ``Field(description=...)`` with its unit (seconds,
bytes, bits/s, tokens) in its name or description; unknown keys are refused.

==========================  ===============================================================
module                      models
==========================  ===============================================================
:mod:`dips.spec.base`       :class:`Strict`, :class:`SpecError`, :func:`load_yaml`
:mod:`dips.spec.training`   :class:`ModelConfig`, :class:`DataConfig`, :class:`InnerConfig`,
                            :class:`OuterConfig`, :class:`PenaltyConfig`
:mod:`dips.spec.cluster`    :class:`Transient`, :class:`RateChange`, :class:`LinkConfig`,
                            :class:`ClusterConfig`
:mod:`dips.spec.protocol`   :class:`GraceConfig`, :class:`MembershipConfig`, :class:`Timeouts`
:mod:`dips.spec.evaluate`   :class:`EvaluateConfig` (``evaluate:``, the launched evaluator)
:mod:`dips.spec.run`        :class:`RunConfig` (``dips launch``), :class:`LeaderConfig`,
                            :class:`RunSpec` (``run.json``)
:mod:`dips.spec.scenario`   :class:`Scenario` (``dips bench compare``), :class:`Timing`,
                            :class:`RealTime`, :class:`WeakScaling`
:mod:`dips.spec.worker`     :class:`WorkerSpec` (real-time baselines' ``spec.json``),
                            :class:`Endpoint`
==========================  ===============================================================
"""

from dips.spec.base import SpecError, Strict, format_validation_error, load_yaml, validate
from dips.spec.cluster import ClusterConfig, LinkConfig, RateChange, Transient
from dips.spec.evaluate import EvaluateConfig
from dips.spec.protocol import GraceConfig, MembershipConfig, Timeouts
from dips.spec.run import TBF_MIN_BPS, LeaderConfig, RunConfig, RunSpec, load_config
from dips.spec.scenario import (DEFAULT_LINK_BPS, METHODS, PAPER_TRANSFER_OVER_ROUND, RealTime,
                                Scenario, Timing, WeakScaling, load_scenario, paper_bytes_scale,
                                spread)
from dips.spec.training import DataConfig, InnerConfig, ModelConfig, OuterConfig, PenaltyConfig
from dips.spec.worker import Endpoint, WorkerSpec

__all__ = [
    "DEFAULT_LINK_BPS", "METHODS", "PAPER_TRANSFER_OVER_ROUND", "TBF_MIN_BPS", "ClusterConfig",
    "DataConfig", "Endpoint", "EvaluateConfig", "GraceConfig", "InnerConfig", "LeaderConfig",
    "LinkConfig", "MembershipConfig",
    "ModelConfig", "OuterConfig", "PenaltyConfig", "RateChange", "RealTime", "RunConfig",
    "RunSpec", "Scenario", "SpecError", "Strict", "Timeouts", "Timing", "Transient",
    "WeakScaling", "WorkerSpec", "format_validation_error", "load_config", "load_scenario",
    "load_yaml", "paper_bytes_scale", "spread", "validate",
]
