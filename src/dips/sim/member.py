"""One simulated cluster: its state over time, its data position, its counters.

States (seconds in each are summed in :attr:`Member.totals`):

* ``compute``: H inner steps; ``admit``: push requested, not yet admitted into a round;
  ``push``: its stage workers send; ``verdict``: pushed, waiting for the round's decision;
  ``pull``: fetching the version of its verdict. admit + push + verdict + pull is the PS's
  overhead on the cluster (the §16 "time Di-PS adds").
* ``join``: (re)joining and pulling the whole model; ``down``: failed, not yet back;
  ``idle``: before its first join; ``stopped``: the run finished for it.
"""

from __future__ import annotations

from typing import Callable

from dips.algo.hold import BACKOFF_FIRST_S
from dips.algo.ledger import ChunkLedger
from dips.sim import costs
from dips.spec import ClusterConfig
from dips.spec.simulate import SimCluster, SimScenario

__all__ = ["OVERHEAD", "Member"]

#: The states that count as the PS's overhead on a cluster.
OVERHEAD = ("admit", "push", "verdict", "pull")


class Member:
    """Cluster ``cid`` (type ``cfg``); ``stages``: each stage worker's layer indices."""

    def __init__(self, cid: str, index: int, cfg: SimCluster, sc: SimScenario,
                 stages: list[range]) -> None:
        self.cid, self.index, self.cfg = cid, index, cfg
        self.H = cfg.H or sc.H
        self.spec = ClusterConfig(id=cid, slowdown=cfg.slowdown, stages=cfg.stages,
                                  transient=cfg.transient, link=cfg.uplink)
        self.rng = costs.streams(sc.seed, index)
        self.stage_layers = [list(r) for r in stages]
        self.pull_plan: list[list[tuple[int, float]]] | None = None  # per stage worker
        self.windows_per_chunk = sc.data.windows_per_chunk
        self.timeline_s = sc.timeline_s
        self.state, self.since = "idle", 0.0
        self.totals: dict[str, float] = {}
        self.timeline: list[tuple[str, float, float]] = []
        self.epoch = 0
        self.down = False
        self.job = None
        self.base_version = 0
        self.positions: dict[int, int] = {}
        self.progress: dict[int, int] = {}  # chunk -> position reached by its last H steps
        self.push_no = 0
        self.push_id = ""
        self.tries = self.retries = 0  # requests of the current push; retries of all pushes
        self.backoff_s = BACKOFF_FIRST_S  # the client's wait after its next failure
        self.requested_at = self.admitted_at = self.pull_started = 0.0
        self.last_push_s: float | None = None
        self.push_s: list[float] = []
        self.pull_s: list[float] = []
        self.faults = self.accepted = self.rejected = self.tokens_accepted = 0
        self.windows_short = 0  # windows not trained for want of a chunk to lease

    def set_state(self, state: str, t: float) -> None:
        """Enter ``state`` at ``t`` seconds (the time in the old one is added to its total)."""
        self.totals[self.state] = self.totals.get(self.state, 0.0) + (t - self.since)
        if self.since < self.timeline_s and t > self.since:
            self.timeline.append((self.state, self.since, t))
        self.state, self.since = state, t

    def close(self, t: float) -> None:
        """End of the run at ``t``."""
        self.set_state(self.state, t)

    def compute_s(self, t: float) -> float:
        """Seconds of the H inner steps started at ``t`` (:func:`dips.sim.costs.compute_s`)."""
        return costs.compute_s(self.cfg, self.spec, t, self.H, self.rng["compute"])

    def train(self, ledger: ChunkLedger, lease: Callable[[], None]) -> dict[int, int]:
        """Advance through the held chunks by the windows of H steps (leasing more when all
        are done; ``lease`` tops them up); returns chunk -> position reached, for the ledger.
        Windows left over when no chunk can be leased are counted in ``windows_short``."""
        held = {c for c, _ in ledger.holdings(self.cid)}
        self.positions = {c: p for c, p in self.positions.items() if c in held}
        left = self.cfg.windows_per_step * self.H
        while left > 0:
            open_ = [c for c in sorted(self.positions) if self.positions[c] < self.windows_per_chunk]
            if not open_:
                lease()
                open_ = [c for c in sorted(self.positions)
                         if self.positions[c] < self.windows_per_chunk]
                if not open_:
                    break
            c = open_[0]
            take = min(left, self.windows_per_chunk - self.positions[c])
            self.positions[c] += take
            left -= take
        self.windows_short += left
        return dict(self.positions)

    def new_push(self, t: float) -> None:
        """A new push id (deterministic: ``<cid>-<n>``), requested at ``t``."""
        self.push_no += 1
        self.push_id = f"{self.cid}-{self.push_no}"
        self.requested_at = t
        self.tries = 1

    def retry_push(self) -> None:
        """The same push asked again after its request was withdrawn (a new push id, as the
        real leader gives each request: ``<cid>-<n>.<try>``; the push number stays)."""
        self.tries += 1
        self.retries += 1
        self.push_id = f"{self.cid}-{self.push_no}.{self.tries}"

    def verdict(self, accepted: bool, tokens: int) -> None:
        """Count a verdict (``tokens`` newly accepted)."""
        if accepted:
            self.accepted += 1
            self.tokens_accepted += tokens
        else:
            self.rejected += 1
