"""The leader's control messages in a simulated run: what it receives, one per RPC (seed §5, §12).

Each gRPC call the real leader takes part in brings it exactly one message: the request of a
call into it (``proto/dips/v1/control.proto``'s Leader service: JoinCluster, GetSpec,
RequestPush, PushDone, PullDone, Lease, Heartbeat, RegisterFollower) or the reply of a call it
makes to a follower (the Follower service: Score, Aggregate, Discard, Apply, Commit, Abort,
Restore, GetState, Fence). The simulator counts each where the real roles make it; the
follower calls are those :func:`dips.roles.outer_step.run_update` and the reconciliation make
on the modelled followers (:class:`dips.sim.followers.ModelledFollower` logs each call it
answers on the :class:`~dips.sim.followers.NormBoard`), timed as the leader makes them.

Heartbeats are not events of the queue (a 30-day, 1,024-cluster run has 10⁸ of them); their
times follow from the protocol and are counted afterwards (:class:`Beats`): a cluster's
heartbeat thread starts when its join is answered, beats first at a random offset within the
interval and every interval after it (:mod:`dips.roles.client_hold`,
:func:`dips.algo.ratelimit.first_beat_delay`; a re-join within the same process keeps it
running); a follower registers when it starts, again at a random offset within the interval,
then every interval (``dips.node.follower``: the registration is its heartbeat), a restarted
one likewise, a resumed (stopped) one at once and every interval from there. The offsets are
drawn from a generator of their own, seeded from the scenario's seed (:func:`beat_stream`),
in the order of the events: same seed, same beats. A process that fails stops beating; beats
sent while the leader is down are not received. They are counted where they fall, per 1-s
bin, not spread evenly (before issue 16's offset, members that started together beat in the
same second for as long as they lived).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dips.algo.ratelimit import first_beat_delay

__all__ = ["FOLLOWER_CALLS", "Beats", "Messages", "beat_stream"]

#: Second word of the seed of the heartbeat offsets' generator (clusters use [seed, index]).
_BEAT_STREAM = 0xB3A7

#: The Follower service's calls (the leader receives their replies); the rest come from members.
FOLLOWER_CALLS = ("Score", "Aggregate", "Discard", "Apply", "Commit", "Abort", "Restore",
                  "GetState", "Fence")


class Messages:
    """A mixin of :class:`dips.sim.engine.Simulation`: ``msgs`` (RPC name -> messages),
    ``bins`` (1-s bin -> messages, heartbeats aside), ``follower_bins`` (the same for the
    replies of the leader's calls to followers), ``board.calls`` (the calls the modelled
    followers answered, not yet counted) and ``first_request_s`` (the first RequestPush: the
    start-up's messages all come before it)."""

    first_request_s: float | None = None
    beats: "Beats"
    _beat_rng: np.random.Generator
    msgs: Any
    bins: Any
    follower_bins: Any
    board: Any

    def _message(self, t: float, kind: str, n: int = 1) -> None:
        """``n`` control messages of ``kind`` reaching the leader at ``t`` seconds."""
        if kind == "RequestPush" and self.first_request_s is None:
            self.first_request_s = t  # the start-up (specs, joins, leases, reconciling) is over
        self.msgs[kind] += n
        self.bins[int(t)] += n
        if kind in FOLLOWER_CALLS:
            self.follower_bins[int(t)] += n

    def _beat_from(self, key: Any, kind: str, t: float, at_once: bool = False) -> None:
        """A new process of member ``key`` starts its heartbeat loop at ``t`` seconds: its
        first beat after :func:`dips.algo.ratelimit.first_beat_delay` of a fresh draw, every
        interval after it; ``at_once``: it also beats at ``t`` (a follower's registration)."""
        u = float(self._beat_rng.random())
        self.beats.start(key, kind, t + first_beat_delay(self.beats.period_s, u),
                         t if at_once else None)

    def _follower_calls(self, t: float, at: dict[str, dict[int, float]] | None = None) -> None:
        """Count the calls the modelled followers answered since the last count, each reply
        at ``t`` seconds, or for an RPC named in ``at`` at ``at[rpc][follower index]``."""
        calls, self.board.calls = self.board.calls, []
        for rpc, index in calls:
            self._message((at or {}).get(rpc, {}).get(index, t), rpc)


def beat_stream(seed: int) -> np.random.Generator:
    """The generator of a run's heartbeat offsets (u uniform in [0, 1)), from ``seed``."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, _BEAT_STREAM])))


class Beats:
    """The heartbeat lives of a run: each member beats once at ``once_s`` (if given: a
    follower's registration when it starts) and at ``first + k × period_s`` (k ≥ 0) until it
    stops; ``period_s`` > 0 seconds (the membership's heartbeat interval)."""

    def __init__(self, period_s: float) -> None:
        if not (math.isfinite(period_s) and period_s > 0):
            raise ValueError(f"heartbeat period_s = {period_s!r} must be a positive number")
        self.period_s = period_s
        self.open: dict[Any, tuple[str, float, float | None]] = {}
        self.lives: list[tuple[str, float, float, float | None]] = []
        self.leader_down: list[list[float]] = []

    def is_open(self, key: Any) -> bool:
        """Whether member ``key`` is beating (its process alive)."""
        return key in self.open

    def start(self, key: Any, kind: str, first_s: float, once_s: float | None = None) -> None:
        """Member ``key`` beats ``kind`` messages once at ``once_s`` (None: not) and every
        period from ``first_s`` on (no-op if it already beats: one heartbeat loop per
        process)."""
        self.open.setdefault(key, (kind, first_s, once_s))

    def stop(self, key: Any, t: float) -> None:
        """Member ``key``'s process stops at ``t`` (no beat at or after ``t``)."""
        life = self.open.pop(key, None)
        if life is not None:
            self.lives.append((life[0], life[1], t, life[2]))

    def leader(self, t: float, down: bool) -> None:
        """The leader goes down (``down``) or serves again at ``t``: beats in between are lost."""
        if down:
            self.leader_down.append([t, math.inf])
        elif self.leader_down and self.leader_down[-1][1] == math.inf:
            self.leader_down[-1][1] = t

    def histogram(self, end_s: float, bins: int) -> tuple[dict[str, int], np.ndarray]:
        """The beats the leader received before ``end_s``: counts per kind and beats per 1-s
        bin (int64, ``bins`` bins from 0 s; ``bins`` > ``end_s``)."""
        hist = np.zeros(bins, dtype=np.int64)
        counts: dict[str, int] = {}
        down = np.asarray(self.leader_down, dtype=float).reshape(-1, 2)
        lives = self.lives + [(k, s, end_s, o) for k, s, o in self.open.values()]
        for kind, first, end, once in lives:
            end = min(end, end_s)
            n = max(0, math.ceil((end - first) / self.period_s))
            times = first + self.period_s * np.arange(n)
            if once is not None:
                times = np.concatenate(([once], times))
            times = times[times < end]
            if not len(times):
                counts.setdefault(kind, 0)
                continue
            for a, b in down:
                times = times[(times < a) | (times >= b)]
            idx = times.astype(np.int64)
            if self.period_s >= 1.0 and once is None:  # one beat per bin: plain indexing adds
                hist[idx] += 1
            else:
                np.add.at(hist, idx, 1)
            counts[kind] = counts.get(kind, 0) + len(idx)
        return counts, hist
