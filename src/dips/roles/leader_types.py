"""Types shared by the leader's modules: its view of followers and clusters, rounds, config.

Split from :mod:`dips.roles.leader` to keep each module small; see it for the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from dips.algo import PenaltyConfig


class FollowerControl(Protocol):
    """What the leader needs from a follower (gRPC in production, the shard itself in tests)."""

    def score(self, rnd: int, clusters: list[str]) -> list[tuple[str, bool, float, str]]: ...
    def aggregate(self, rnd: int, clusters: list[str], weights: list[float]) -> float: ...
    def apply(self, rnd: int, clip: float, new_version: int, accepted: list[str],
              weights: list[float]) -> tuple[int, str]: ...
    def commit(self, new_version: int) -> tuple[int, str]: ...
    def abort(self, rnd: int) -> None: ...
    def restore(self, version: int) -> tuple[int, str]: ...
    def discard(self, rnd: int) -> None: ...
    def report(self) -> tuple[int, int, list[int]]: ...


@dataclass
class FollowerEntry:
    index: int
    data_endpoint: str
    control_endpoint: str
    layers: list[str]
    layer_bytes: list[int]
    incarnation: int = 0
    control: FollowerControl | None = None
    last_seen: float = 0.0
    up: bool = True


@dataclass
class ClusterEntry:
    cluster_id: str
    stages: list[list[str]]
    inner_step: int = 0
    tokens: int = 0
    last_loss: float = float("nan")
    last_push: str = "-"
    pulled_version: int = -1
    last_seen: float = 0.0


@dataclass
class Push:
    """One admitted push request of a round."""

    cluster_id: str
    push_id: str
    base_version: int
    tokens: int
    done: bool = False
    ok: bool = False
    error: str = ""
    pulled: bool = False
    verdict: dict[str, Any] | None = None


@dataclass
class Round:
    number: int
    opened_at: float
    closes_at: float
    pushes: dict[str, Push] = field(default_factory=dict)


@dataclass(frozen=True)
class LeaderConfig:
    """Leader settings. Times in seconds.

    Attributes:
        grace_window_s: fixed grace window length (§6, §7); with ``grace_mode`` "dynamic"
            the window until λ and C_m are estimated.
        grace_mode: "fixed" or "dynamic" (§7: τ* = (1/λ)·ln(C_m·λ), :mod:`dips.algo.grace`).
        grace_max_s: upper clamp of the dynamic window.
        push_timeout_s / pull_timeout_s: waits for the round's pushes / pulls.
        max_norm: global clip threshold c (§8; None disables clipping, an ablation).
        uniform_weights: ablation: 1/n instead of token weights.
        heartbeat_interval_s: expected heartbeat period; silence for ``missed_heartbeats``
            periods removes a cluster or marks a follower down (§12: 3).
        followers: how many followers the model is sharded over.
        penalty: §8 settings (α, β, warm-up).
        pull_barrier: True: the seed's §6 round, the next window opens once every cluster of
            the round has pulled; False (default): it opens as soon as the update is
            committed, while the round's clusters still pull their version.
    """

    grace_window_s: float = 1.0
    grace_mode: str = "fixed"
    grace_max_s: float = 30.0
    push_timeout_s: float = 60.0
    pull_timeout_s: float = 60.0
    max_norm: float | None = 1.0
    uniform_weights: bool = False
    heartbeat_interval_s: float = 1.0
    missed_heartbeats: int = 3
    followers: int = 1
    penalty: PenaltyConfig = field(default_factory=PenaltyConfig)
    pull_barrier: bool = False
