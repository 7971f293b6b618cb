"""Types of the leader's shell: its view of followers and clusters, and the typed replies of
push admission and verdicts. Its config is :class:`dips.spec.LeaderConfig` (re-exported here).

Split from :mod:`dips.roles.leader` to keep each module small; see it for the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dips.algo.round import Verdict
from dips.spec import LeaderConfig
from dips.wire.keys import new_secret

__all__ = ["ClusterEntry", "FollowerEntry", "Grant", "HeartbeatAnswer", "Issued", "LeaderConfig",
           "LeaderStatus", "RegisterAnswer", "VerdictReply"]


@dataclass(frozen=True)
class Issued:
    """What the leader process hands to members (from its state directory).

    Attributes:
        term: this leader's term (fencing token, :mod:`dips.algo.fencing`), >= 1.
        data_secret: derives every member's data-plane key (:mod:`dips.wire.keys`); only
            followers receive it.
        run_spec: the run spec, JSON (``dips.spec.RunSpec``), served to members ("" in tests).
        fingerprint: the model fingerprint, JSON (``dips.spec.fingerprint``); "" : no check.
        encrypt: members encrypt tensor bytes on the data plane.
    """

    term: int = 1
    data_secret: bytes = field(default_factory=new_secret, repr=False)
    run_spec: str = ""
    fingerprint: str = ""
    encrypt: bool = False


@dataclass(frozen=True)
class RegisterAnswer:
    """The leader's reply to a follower's registration: its term and the data secret."""

    term: int
    data_secret: bytes
    encrypt: bool = False
    member_keys: tuple[str, ...] = ()  # the current members' data-plane key ids
    next_key_seq: int = 0


@dataclass
class FollowerEntry:
    """A registered follower: where it serves (data: ZeroMQ, control: gRPC), what it owns."""

    index: int
    data_endpoint: str
    control_endpoint: str
    layers: list[str]
    layer_bytes: list[int]
    incarnation: int = 0
    leader_term: int = 0  # the highest leader term the follower has accepted
    version: int = 0      # the version the follower holds (committed)
    control: Any = None  # a dips.roles.outer_step.FollowerControl once registered
    last_seen: float = 0.0
    up: bool = True
    data_plane_error: str = ""  # non-empty: its data plane stopped serving (why)


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
    #: The lowest version the member can hold (:func:`dips.algo.limits.push_base_version`):
    #: the version it joined at, raised by each verdict's version and each pull it reported.
    floor_version: int = 0
    #: T_j of its pushes decided and of its accepted pushes still in the model, over every
    #: process it ran as (the leader's ledger counts, checkpointed; filled in by
    #: ``Leader.status``, 0 in the live entry). Review 28 of issue 15, #2.
    tokens_pushed: int = 0
    tokens_accepted: int = 0


@dataclass(frozen=True)
class Grant:
    """A push admitted into round ``round``: its id, the leader's version at admission and
    the §10 schedule ``[[(stage, layer, follower), ...], ...]``. ``stage_first``: the push is
    sent now, ahead of any round (``round`` 0), and joins a round once it arrived.
    ``ticket``/``ticket_mac``: the signed admission ticket (:mod:`dips.wire.admission`; JSON,
    32-byte HMAC) the cluster copies into every push header ("" / b"": none)."""

    push_id: str
    round: int
    version: int
    schedule: list[list[tuple[int, str, int]]]
    stage_first: bool = False
    ticket: str = ""
    ticket_mac: bytes = b""


@dataclass(frozen=True)
class HeartbeatAnswer:
    """The leader's answer to a cluster's heartbeat: the global ``version``; ``known`` False
    when the cluster must re-join; ``followers_epoch`` rises whenever a follower is marked
    down or registers as a new incarnation (a cluster aborts transfers started before);
    ``finished``: why the run ended ("" while it runs): the cluster stops."""

    version: int
    known: bool
    followers_epoch: int
    finished: str = ""


@dataclass(frozen=True)
class VerdictReply:
    """A push's verdict and the ledger positions ``[(chunk, window), ...]`` to continue from."""

    verdict: Verdict
    holdings: list[tuple[int, int]]


@dataclass(frozen=True)
class LeaderStatus:
    """The run as the leader sees it (``GetStatus``): version, rounds, phase, counts (updates,
    tokens, outer steps, rolled-back steps), members, followers (those registered, and how
    many the run has) and the ledger's state; ``finished``: why the run ended ("" while it
    runs)."""

    version: int
    rounds: int
    phase: str
    counts: dict[str, int]
    clusters: list[ClusterEntry]
    followers: list[FollowerEntry]
    followers_ready: int
    accepted_windows: int
    ledger_epoch: int
    finished: str = ""
    now: float | None = None  # the leader's clock at the snapshot (heartbeat ages: now - last_seen)
    followers_configured: int = 0  # the run's followers (its spec), registered or not
