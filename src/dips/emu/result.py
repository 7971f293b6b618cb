"""What one method's run in a comparison reports (seed §13–§15, §18: the figures to compare).

Every runner of ``dips bench compare``, virtual time or real time, Di-PS or a baseline,
returns a :class:`MethodResult`; the report, the JSON and the plots read only this.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class CurvePoint:
    """One evaluation of the global model (for a baseline: of cluster 0's replica).

    Attributes:
        time_s: (virtual) seconds since the start of training.
        tokens: tokens consumed by all clusters so far.
        eval_loss: validation loss, nats/token, on the held-out split.
    """

    time_s: float
    tokens: int
    eval_loss: float


@dataclass
class MethodResult:
    """Outcome of one method on one scenario.

    Attributes:
        method: ``dp``, ``diloco``, ``async-diloco``, ``di-ps`` or a Di-PS ablation
            (``di-ps-no-penalty``, ``di-ps-uniform``, ``di-ps-no-clip``, ``di-ps-no-grace``,
            ``di-ps-pull-barrier``).
        mode: ``virtual`` or ``real``.
        time_s: (virtual) seconds to reach the token budget.
        tokens: tokens consumed by all clusters (inner steps actually run).
        tokens_accepted: effective tokens: those behind updates that reached the global model.
        comm_s: cumulative outer communication time, seconds, summed over clusters.
        updates_pushed / updates_accepted / updates_rejected: outer updates (DP: 0).
        final_eval_loss: validation loss at the end, nats/token.
        tokens_per_s: aggregate throughput, tokens / time_s.
        curve: evaluations over the run.
        shaping: how bandwidth was enforced: ``virtual`` (charged by the clock),
            ``tc-tbf`` (kernel, network namespaces), ``token-bucket`` (application), ``none``.
        extra: method-specific figures (e.g. per-cluster idle time, mean staleness).
    """

    method: str
    mode: str
    time_s: float
    tokens: int
    tokens_accepted: int
    comm_s: float
    updates_pushed: int
    updates_accepted: int
    updates_rejected: int
    final_eval_loss: float
    tokens_per_s: float
    curve: list[CurvePoint] = field(default_factory=list)
    shaping: str = "virtual"
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (curve points as dicts)."""
        return asdict(self)
