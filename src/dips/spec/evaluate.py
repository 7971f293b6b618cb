"""The periodic evaluator of a launched run (issue 15): ``evaluate:`` in the run config.

``dips launch`` starts ``dips evaluate`` (the operator's identity, pull-only) as one more child
process when the section is present; ``evaluate: null`` (the default) starts none. A run
deployed by hand starts ``dips evaluate --every N`` itself (README "dips evaluate").
"""

from __future__ import annotations

from pydantic import Field

from dips.spec.base import Strict

__all__ = ["EvaluateConfig"]


class EvaluateConfig(Strict):
    """How often the launched evaluator measures the global model's held-out loss."""

    every: int = Field(ge=1, description="evaluate every this many versions (versions); the "
                                         "final version is evaluated too")
