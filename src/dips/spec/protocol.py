"""Settings of the outer-step protocol: grace window, membership, timeouts (§6, §7, §12).

All times are seconds.  The leader reads them through :class:`dips.spec.run.LeaderConfig`,
the cluster and follower processes through :class:`dips.spec.run.RunConfig`, the comparison
scenarios through :class:`dips.spec.scenario.Scenario` (virtual time: ``grace.window_s``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dips.spec.base import Strict

__all__ = ["GraceConfig", "MembershipConfig", "Timeouts"]


class GraceConfig(Strict):
    """The grace window of an outer step (§6, §7) and when the next one may open.

    The first push request of a round opens the window; requests arriving before it closes
    join the same outer step.  ``mode: fixed`` keeps it ``window_s`` long; ``mode: dynamic``
    uses the ski-rental τ* = (1/λ)·ln(C_m·λ) of §7 (:mod:`dips.algo.grace`), clamped to
    [0, ``max_s``], and ``window_s`` until λ and C_m are measured.  The default window, 8 s,
    is the seed's §11 example.
    """

    mode: Literal["fixed", "dynamic"] = Field(
        "fixed", description="fixed: window_s; dynamic: τ* = ln(C_m·λ)/λ of §7")
    window_s: float = Field(8.0, ge=0, allow_inf_nan=False,
                            description="grace window, seconds (dynamic mode: until estimated)")
    max_s: float = Field(30.0, ge=0, allow_inf_nan=False,
                         description="upper clamp of the dynamic window, seconds")
    pull_barrier: bool = Field(
        False, description="True: the seed's §6 round, no new window until every cluster of "
                           "the round has pulled; False: the next window opens once the update "
                           "is committed (a slow pull delays only its own cluster)")


class MembershipConfig(Strict):
    """Heartbeats and failure detection (§12: a cluster silent for 3 intervals is removed)."""

    heartbeat_interval_s: float = Field(1.0, gt=0, allow_inf_nan=False,
                                        description="heartbeat period of clusters and followers, "
                                                    "seconds")
    missed_heartbeats: int = Field(3, ge=1, description="silent intervals after which a cluster "
                                                        "is removed or a follower marked down")
    rejoin_min_s: float = Field(1.0, gt=0, allow_inf_nan=False,
                                description="the shortest interval between two joins of one "
                                            "cluster after a few in a row, seconds; it doubles "
                                            "with each join sooner than 2 × rejoin_max_s after "
                                            "the one before (dips.algo.limits.join_allowed)")
    rejoin_max_s: float = Field(300.0, gt=0, allow_inf_nan=False,
                                description="the longest a cluster waits to re-join, seconds; a "
                                            "join twice this long after the one before starts "
                                            "afresh")
    read_calls_per_s: float = Field(20.0, gt=0, allow_inf_nan=False,
                                    description="read calls (GetStatus, GetSpec) per second one "
                                                "member may make at the leader, sustained; "
                                                "beyond: refusal BUSY (RESOURCE_EXHAUSTED)")
    read_burst: int = Field(40, ge=1, description="read calls one member may make at once "
                                                  "after a quiet while (read_calls_per_s)")


class Timeouts(Strict):
    """Seconds for each blocking phase (every wait in dips has a timeout)."""

    rpc_s: float = Field(120.0, gt=0, description="one control-plane call, seconds")
    admit_s: float = Field(30.0, gt=0, description="a cluster's wait to be admitted to a round, "
                                                   "seconds")
    push_s: float = Field(60.0, gt=0, description="the longest wait of the leader for a round's "
                                                  "pushes (the ceiling once push times are "
                                                  "measured); a cluster's wait for its verdict, "
                                                  "seconds")
    push_floor_s: float = Field(2.0, ge=0, allow_inf_nan=False,
                                description="once push times are measured, a round waits "
                                            "push_floor_s + push_slack × the slowest predicted "
                                            "push of its members (at most push_s), seconds")
    push_slack: float = Field(4.0, ge=1, description="multiple of the measured push time a round "
                                                     "waits (see push_floor_s); inf: push_s only")
    pull_s: float = Field(60.0, gt=0, description="the leader's wait for a round's pulls, seconds")
    startup_s: float = Field(180.0, gt=0, description="process start-up and registration, seconds")
    shutdown_s: float = Field(30.0, gt=0, description="SIGTERM to SIGKILL at the end, seconds")
