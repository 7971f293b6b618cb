"""Types of the leader's shell: its view of followers and clusters, and the typed replies of
push admission and verdicts. Its config is :class:`dips.spec.LeaderConfig` (re-exported here).

Split from :mod:`dips.roles.leader` to keep each module small; see it for the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dips.algo.round import Verdict
from dips.spec import LeaderConfig

__all__ = ["ClusterEntry", "FollowerEntry", "Grant", "HeartbeatAnswer", "LeaderConfig",
           "LeaderStatus", "VerdictReply"]


@dataclass
class FollowerEntry:
    """A registered follower: where it serves (data: ZeroMQ, control: gRPC), what it owns."""

    index: int
    data_endpoint: str
    control_endpoint: str
    layers: list[str]
    layer_bytes: list[int]
    incarnation: int = 0
    control: Any = None  # a dips.roles.outer_step.FollowerControl once registered
    last_seen: float = 0.0
    up: bool = True


@dataclass
class ClusterEntry:
    """A member cluster as the leader sees it (progress from heartbeats; tokens in tokens)."""

    cluster_id: str
    stages: list[list[str]]
    inner_step: int = 0
    tokens: int = 0
    last_loss: float = float("nan")
    last_push: str = "-"
    pulled_version: int = -1
    last_seen: float = 0.0


@dataclass(frozen=True)
class Grant:
    """A push admitted into round ``round``: its id, the leader's version at admission and
    the §10 schedule ``[[(stage, layer, follower), ...], ...]``. ``stage_first``: the push is
    sent now, ahead of any round (``round`` 0), and joins a round once it arrived."""

    push_id: str
    round: int
    version: int
    schedule: list[list[tuple[int, str, int]]]
    stage_first: bool = False


@dataclass(frozen=True)
class HeartbeatAnswer:
    """The leader's answer to a cluster's heartbeat: the global ``version``; ``known`` False
    when the cluster must re-join; ``followers_epoch`` rises whenever a follower is marked
    down or registers as a new incarnation (a cluster aborts transfers started before)."""

    version: int
    known: bool
    followers_epoch: int


@dataclass(frozen=True)
class VerdictReply:
    """A push's verdict and the ledger positions ``[(chunk, window), ...]`` to continue from."""

    verdict: Verdict
    holdings: list[tuple[int, int]]


@dataclass(frozen=True)
class LeaderStatus:
    """The run as the leader sees it (``GetStatus``): version, rounds, phase, counts (updates,
    tokens, outer steps, rolled-back steps), members, followers and the ledger's state."""

    version: int
    rounds: int
    phase: str
    counts: dict[str, int]
    clusters: list[ClusterEntry]
    followers: list[FollowerEntry]
    followers_ready: int
    accepted_windows: int
    ledger_epoch: int
