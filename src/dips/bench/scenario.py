"""Comparison scenarios of ``dips bench compare``: defined in :mod:`dips.spec.scenario`.

A scenario is configuration, so it lives in the configuration layer (:mod:`dips.spec`); this
module only re-exports it for the benchmark code that reads ``dips.bench.scenario``.
"""

from dips.spec.scenario import (DEFAULT_LINK_BPS, METHODS, PAPER_TRANSFER_OVER_ROUND, RealTime,
                                Scenario, Timing, WeakScaling, load_scenario, paper_bytes_scale)

__all__ = ["DEFAULT_LINK_BPS", "METHODS", "PAPER_TRANSFER_OVER_ROUND", "RealTime", "Scenario",
           "Timing", "WeakScaling", "load_scenario", "paper_bytes_scale"]
