"""Random follower and leader crashes of a simulated run (an MTBF each; §12, §16).

A mixin of :class:`dips.sim.engine.Simulation`. With ``followers.mtbf_s`` each follower fails
after an exponential time of that mean (counted from when it is back), stopped or killed as
``followers.fault_action`` says, for ``fault_down_s`` seconds (a killed one restarts
``fault_checkpoint_lag`` versions behind); with ``leader.mtbf_s`` the leader crashes likewise
and serves again ``leader.restart_s`` seconds later. A random fault is carried out by the same
code as a scheduled one (:mod:`dips.sim.faults`: ``_on_follower_fault`` and its detection by
the missed heartbeats, readiness, reconciliation and rollback; ``_on_leader_fault`` and the
restart from what ``leader.json`` holds), only its time is drawn instead of named by a round
and phase. The one difference: the simulated update phase makes its calls to the followers at
its start (the outer step's seconds are charged after them), so a fault that falls inside an
update's modelled seconds acts as one right after its commits.

The draws come from their own generators (:func:`server_streams`: one per follower and one
for the leader, from the scenario's seed), so a run without random server faults is the same
as before, and each follower's faults do not shift with the others'.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = ["RandomFaults", "RandomFollowerFault", "RandomLeaderFault", "server_streams"]

#: Second word of the seed of the server-fault generators (cluster streams use [seed, index]).
_SERVER_STREAM = 0x5E4FA17


class RandomFollowerFault(NamedTuple):
    """What a drawn follower fault does (the fields :class:`dips.spec.simulate.SimFollowerFault`'s
    handlers read): follower index, ``stop`` or ``kill``, seconds down, checkpoint lag."""

    follower: int
    action: str
    down_s: float
    checkpoint_lag: int


class RandomLeaderFault(NamedTuple):
    """A drawn leader crash: seconds until the restarted leader serves."""

    restart_s: float


def server_streams(seed: int, followers: int) -> list[np.random.Generator]:
    """Independent generators for followers 0 … ``followers`` - 1 and, last, the leader."""
    children = np.random.SeedSequence([seed, _SERVER_STREAM, 0]).spawn(followers + 1)
    return [np.random.Generator(np.random.PCG64(c)) for c in children]


class RandomFaults:
    """Random follower and leader faults (see the module docstring)."""

    def _init_random_faults(self) -> None:
        sc = self.sc
        f, lead = sc.followers, sc.leader
        if f.mtbf_s is None and lead.mtbf_s is None:
            return
        self._server_rng = server_streams(sc.seed, f.count)
        if f.mtbf_s is not None:
            for i in range(f.count):
                self.q.push(float(self._server_rng[i].exponential(f.mtbf_s)),
                            "random_follower_fault", i)
        if lead.mtbf_s is not None:
            self.q.push(float(self._server_rng[-1].exponential(lead.mtbf_s)),
                        "random_leader_fault")

    def _on_random_follower_fault(self, t: float, i: int) -> None:
        """Follower ``i`` fails now (unless a scheduled fault has it down already); its next
        fault is drawn from when it is back."""
        f = self.sc.followers
        if self.followers[i][1].alive:
            self.counts["random_follower_faults"] += 1
            self._on_follower_fault(t, RandomFollowerFault(i, f.fault_action, f.fault_down_s,
                                                           f.fault_checkpoint_lag))
        self.q.push(t + f.fault_down_s + float(self._server_rng[i].exponential(f.mtbf_s)),
                    "random_follower_fault", i)

    def _on_random_leader_fault(self, t: float, _: Any) -> None:
        """The leader crashes now (unless it is down already); its next crash is drawn from
        when it serves again."""
        lead = self.sc.leader
        if not self.leader_down:
            self.counts["random_leader_faults"] += 1
            self._on_leader_fault(t, RandomLeaderFault(lead.restart_s))
        self.q.push(t + lead.restart_s + float(self._server_rng[-1].exponential(lead.mtbf_s)),
                    "random_leader_fault")
