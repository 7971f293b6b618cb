"""States, events and actions of the leader's round machine (:mod:`dips.algo.round`, §6).

All immutable; times are seconds on the caller's clock (monotonic or virtual).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from dips.algo.grace import GraceState


class Phase(str, enum.Enum):
    """Phase of the leader's round (the value is what logs and ``GetStatus`` show)."""

    IDLE = "idle"
    WINDOW = "window"
    PUSH = "push"
    UPDATE = "update"
    PULL = "pull"


class RejectCode(str, enum.Enum):
    """Why a push was not accepted, as a bounded code carried in the records (the value is
    what ``outer_steps.jsonl``'s ``rejected[cluster].code``, the faults' ``reason`` and the
    ``dips_pushes_total`` label show). Set where the failure happens, never read from an
    error's text (review of issue 15, #2)."""

    PENALTY = "penalty"  # scored, and its score E above the threshold (§8)
    NOT_DELIVERED = "not_delivered"  # the member reported a failed push, or it timed out
    INVALID = "invalid"  # a follower refused its shard, or ‖Δ‖² is not a finite number
    FOLLOWERS_NOT_READY = "followers_not_ready"  # a follower down, restarted or reconciling
    CLUSTER_GONE = "cluster_gone"  # its cluster was removed (or re-joined) during the round
    #: Not a rejection: its cluster left the run gracefully (stopped, or the run finished), or
    #: was removed after the run finished; the records list its push apart as withdrawn and
    #: count it nowhere (review 33 of issue 15, m3).
    WITHDRAWN = "withdrawn"
    ROUND_FAILED = "round_failed"  # the update failed as a whole: nothing applied anywhere
    OTHER = "other"  # a record of an older version, without a code


@dataclass(frozen=True)
class RoundPolicy:
    """What the round machine needs to know of the run's settings.

    Attributes:
        grace: a :class:`dips.spec.GraceConfig` (``mode``, ``window_s``, ``max_s`` seconds,
            ``pull_barrier``).
        push_timeout_s: the longest a round waits for its pushes after the window closes,
            seconds (the bound while nothing is measured).
        pull_timeout_s: seconds the pull barrier waits for the round's pulls.
        push_slack / push_floor_s: once push times are measured, a round waits
            ``push_floor_s + push_slack × (longest predicted push of its members)`` after the
            window closes (never more than ``push_timeout_s``): a dead or stalled push fails in
            seconds, not at a fixed timeout. ``push_slack`` inf: no deadline but the timeout.
        estimate_alpha: weight of the newest measured push time in a member's estimate.
        stage_ratio / stage_min_s: a member whose predicted push takes at least
            ``stage_min_s`` seconds and more than ``stage_ratio`` times the median of the other
            members' measured pushes sends its push ahead, outside any round, and joins a round
            only once it has arrived: its slow link never holds the others' window or push
            phase. ``stage_ratio`` inf: never by its prediction (a member in
            :attr:`RoundState.send_ahead` still is).
        verdicts_kept: verdicts remembered by push id (re-served to a client that asks again).
    """

    grace: Any
    push_timeout_s: float = 60.0
    pull_timeout_s: float = 60.0
    push_slack: float = 4.0
    push_floor_s: float = 2.0
    estimate_alpha: float = 0.5
    stage_ratio: float = 4.0
    stage_min_s: float = 1.0
    verdicts_kept: int = 1024


@dataclass(frozen=True)
class Slot:
    """One push request: queued (``round`` None) or admitted into round ``round``.

    ``tokens``: T_j, the push's aggregation weight (tokens). ``requested_at``: seconds.
    ``expected_s``: predicted push seconds (None: unknown). ``admitted_at``: when its transfer
    was allowed to start (admitted into a round, or sent ahead of any), seconds.
    ``done``/``ok``/``error``: the push was reported delivered (ok) or failed (error, free
    text for people; ``code``: its :class:`RejectCode`, "" while it has not failed).
    ``reported_at``: when it was reported, timed out or failed, seconds: its measured push
    time is ``reported_at - admitted_at``. ``excused``: failed by its round, not by its member
    (the followers stopped being ready): it counts neither way in the member's estimate.
    ``pulled``: the cluster pulled the round's version (or gave up, or left). ``ahead``: the
    push was sent ahead of any round (a slow link) and joined this one once it arrived.
    """

    cluster_id: str
    push_id: str
    base_version: int
    tokens: int
    requested_at: float
    expected_s: float | None = None
    round: int | None = None
    admitted_at: float | None = None
    done: bool = False
    ok: bool = False
    error: str = ""
    code: str = ""
    reported_at: float | None = None
    excused: bool = False
    pulled: bool = False
    ahead: bool = False


@dataclass(frozen=True)
class Round:
    """One outer step in progress; times in seconds on the caller's clock."""

    number: int
    opened_at: float
    closes_at: float
    slots: Mapping[str, Slot] = field(default_factory=dict)
    push_deadline: float | None = None
    update_started: float | None = None
    update_done: float | None = None
    pull_deadline: float | None = None


@dataclass(frozen=True)
class Verdict:
    """The decision on one push (§8): accepted or not, why, and the version to pull.

    ``score``/``threshold``: E_j and the threshold it was tested against, β·max(floor, recent E)
    of §8 (:func:`dips.algo.penalty.decide`; None in the penalty's warm-up or for a push that
    was never scored). ``clip_factor``: min(1, c/‖δ‖) of the round (None when
    nothing was accepted).
    """

    push_id: str
    cluster_id: str
    round: int
    accepted: bool
    version: int
    reason: str
    score: float | None = None
    threshold: float | None = None
    clip_factor: float | None = None


@dataclass(frozen=True)
class UpdateOutcome:
    """What the update phase decided (the caller's outer step, :mod:`dips.roles.outer_step`).

    ``version``: the global version after the round (unchanged if nothing was applied).
    ``scores`` / ``thresholds``: E_j and its threshold per scored cluster (§8).
    ``invalid``: cluster -> why its push could not be scored (not delivered, refused by a
    follower), free text; ``codes``: cluster -> the :class:`RejectCode` of the same pushes.
    ``error``: set when the round failed and nothing was applied anywhere.
    """

    version: int
    accepted: tuple[str, ...] = ()
    scores: Mapping[str, float | None] = field(default_factory=dict)
    thresholds: Mapping[str, float] = field(default_factory=dict)
    clip_factor: float | None = None
    invalid: Mapping[str, str] = field(default_factory=dict)
    error: str | None = None
    codes: Mapping[str, str] = field(default_factory=dict)

    def code_of(self, cluster: str) -> str:
        """The :class:`RejectCode` value of ``cluster``'s push, which was not accepted: its
        own (not scored), else ``round_failed`` if the round failed, else ``penalty``."""
        own = self.codes.get(cluster)
        if own:
            return RejectCode(own).value
        return (RejectCode.ROUND_FAILED if self.error else RejectCode.PENALTY).value


@dataclass(frozen=True)
class RoundState:
    """Everything the round machine decides from (immutable; :func:`step` returns a new one).

    ``rounds``: the last round's number (rounds opened so far; a caller restarting from a
    checkpoint may start it higher, so that no number is used twice). ``ready``: the followers are
    all registered, up and reconciled (reported by the caller). ``verdicts``: push id ->
    verdict, the most recent ``policy.verdicts_kept``. ``push_s``: cluster -> moving average
    of its measured push seconds (admission to report), updated when a round is decided: only
    a push delivered complete can lower it (review 14, F2). ``send_ahead``: cluster -> the
    complete pushes it still owes since a decided push of its was not delivered complete
    (timed out, failed, or reported delivered but found incomplete), or since it held a pull
    barrier to its deadline: each of its pushes is sent ahead of its round until it has
    delivered them, and no pull barrier waits for it (:func:`dips.algo.stalls.scored`).
    ``stalls``: cluster -> how many of its decided pushes were not delivered complete (never
    decreases: what it owes doubles with each). ``pull_s``: cluster -> moving average of its
    measured pull seconds under the pull barrier (the round's update done to its PullDone),
    from which the barrier's deadline is set (:func:`dips.algo.round.pull_deadline`).
    ``staging``: cluster -> a push sent ahead of any round (a slow link or ``send_ahead``),
    until it has arrived. ``finished``: why the run ended (:class:`RunFinished`; "" while it
    runs): no request is queued and no round opens again.
    """

    phase: Phase = Phase.IDLE
    rounds: int = 0
    ready: bool = True
    queue: tuple[Slot, ...] = ()
    current: Round | None = None
    grace: GraceState = GraceState()
    verdicts: Mapping[str, Verdict] = field(default_factory=dict)
    push_s: Mapping[str, float] = field(default_factory=dict)
    pull_s: Mapping[str, float] = field(default_factory=dict)
    send_ahead: Mapping[str, int] = field(default_factory=dict)
    stalls: Mapping[str, int] = field(default_factory=dict)
    staging: Mapping[str, Slot] = field(default_factory=dict)
    finished: str = ""


# ----- events ----------------------------------------------------------------------------
@dataclass(frozen=True)
class PushRequested:
    """A member asks to push (§6 step 1): T_j = ``tokens``, trained from ``base_version``;
    ``expected_s``: the push time the member predicts from its own link (None: unknown)."""

    now: float
    cluster_id: str
    push_id: str
    base_version: int
    tokens: int
    expected_s: float | None = None


@dataclass(frozen=True)
class PushWithdrawn:
    """The requester stopped waiting for admission (its deadline passed)."""

    now: float
    cluster_id: str
    push_id: str


@dataclass(frozen=True)
class PushReported:
    """A member's stage workers finished sending (``ok``) or failed (``error``)."""

    now: float
    cluster_id: str
    push_id: str
    ok: bool
    error: str = ""

    @property
    def code(self) -> str:
        """The :class:`RejectCode` value of a failed push ("" for one delivered)."""
        return "" if self.ok else RejectCode.NOT_DELIVERED.value


@dataclass(frozen=True)
class UpdateFinished:
    """The update phase of round ``round`` ended with ``outcome``."""

    now: float
    round: int
    outcome: UpdateOutcome


@dataclass(frozen=True)
class PullDone:
    """A cluster of the current round pulled its version (or gave up: it is not waited for)."""

    now: float
    cluster_id: str


@dataclass(frozen=True)
class MemberGone:
    """A cluster left or was removed (missed heartbeats): its queued request is dropped, its
    push in the current round fails with ``reason`` and ``code`` (``withdrawn``: a graceful
    leave, or any once the run has ended; not a rejection) and is not waited for."""

    now: float
    cluster_id: str
    reason: str
    code: RejectCode = RejectCode.CLUSTER_GONE


@dataclass(frozen=True)
class ReadyChanged:
    """The followers became ready (all up and reconciled) or stopped being ready (``reason``:
    e.g. a follower down or restarted; the round in flight then ends at once)."""

    now: float
    ready: bool
    reason: str = "followers not ready"


@dataclass(frozen=True)
class Tick:
    """Time passed: windows close and timeouts expire at or after their deadline."""

    now: float


@dataclass(frozen=True)
class RunFinished:
    """The run reached a limit (``reason``, from :func:`dips.algo.limits.stop_reason`): the
    round in flight ends as usual; queued requests and pushes sent ahead are dropped, new
    requests are refused with ``RUN_FINISHED`` and no round opens again."""

    now: float
    reason: str


Event = Union[PushRequested, PushWithdrawn, PushReported, UpdateFinished, PullDone, MemberGone,
              ReadyChanged, Tick, RunFinished]


# ----- actions ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RoundOpened:
    """Round ``number`` opened at ``opened_at``; its window closes at ``closes_at`` (seconds)."""

    number: int
    opened_at: float
    closes_at: float


@dataclass(frozen=True)
class Admitted:
    """``slot`` joined round ``slot.round``: its stage workers may send now."""

    slot: Slot


@dataclass(frozen=True)
class Staged:
    """``slot``'s push travels now, ahead of any round (its link is too slow to keep a round
    waiting); it joins a round once reported."""

    slot: Slot


@dataclass(frozen=True)
class WindowClosed:
    """Round ``number``'s window closed at ``at``: later requests wait for the next round."""

    number: int
    at: float


@dataclass(frozen=True)
class StartUpdate:
    """Run the update of round ``number`` over ``slots`` (delivered ones have ``ok``)."""

    number: int
    slots: tuple[Slot, ...]


@dataclass(frozen=True)
class Decided:
    """Round ``number`` was decided: one verdict per admitted push; ``rnd`` the round as it
    was decided (its phase times)."""

    number: int
    verdicts: tuple[Verdict, ...]
    rnd: Round | None = None


@dataclass(frozen=True)
class RoundEnded:
    """Round ``number`` ended; durations of its phases in seconds and the §7 estimates."""

    number: int
    window_s: float
    push_s: float
    update_s: float
    pull_s: float
    grace: Mapping[str, Any]


Action = Union[RoundOpened, Admitted, Staged, WindowClosed, StartUpdate, Decided, RoundEnded]
