"""Grace window: how long the first push request keeps the outer step open (§6, §7 of the seed).

The first push request of an outer step opens the window; requests arriving before it closes
join the same outer step, later ones wait for the next (§6). Closing immediately makes a
cluster that finishes seconds later miss the step and wait through a whole update/pull phase;
waiting long idles the fastest cluster (§7). This module has the fixed window (default τ, §11
uses 8 s). The dynamic ski-rental window τ* = (1/λ)·ln(C_m·λ) of §7 is a later addition.

Time is passed in by the caller as float seconds on any monotonic clock; nothing here reads a
clock, so the leader's state machine stays testable with fake time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class FixedGraceWindow:
    """A grace window of constant length (§6, §7 of the seed).

    seconds: window length in seconds (float, finite, >= 0; 0 closes the step at once).

    Raises:
        ValueError: ``seconds`` negative, NaN, inf or not a number (naming the value).
    """

    seconds: float

    def __post_init__(self) -> None:
        s = self.seconds
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
            raise ValueError(f"seconds must be a finite number >= 0, got {s!r}")

    def close_time(self, opened_at: float) -> float:
        """Return when the window closes: ``opened_at + seconds``.

        Args:
            opened_at: arrival time of the step's first push request, float seconds on the
                caller's monotonic clock (finite).

        Returns:
            Close time in the same clock's float seconds. Requests arriving at a time
            <= the close time join the outer step (the leader's policy; stated here so both
            sides use the same comparison).

        Raises:
            ValueError: ``opened_at`` NaN, inf or not a number (naming the value).
        """
        t = opened_at
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ValueError(f"opened_at must be a finite number of seconds, got {t!r}")
        return float(t) + float(self.seconds)
