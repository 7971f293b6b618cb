"""The periodic evaluator's rules (issue 15): which version of the global model ``dips evaluate``
pulls next, how long it waits after a failed pull, and which held-out reports the leader takes.

Pure: no sockets, threads, sleeps or clock (``now`` is passed in, seconds on any monotonic
clock). The evaluator (:mod:`dips.node.evaluate`) and the leader
(:mod:`dips.roles.leader_eval`) both call these functions: one copy of every rule.

Which version: followers serve only their current version, so the evaluator always pulls the
version the leader reports now. It evaluates one when it reaches the next multiple of
``every`` after the last one evaluated (the first look evaluates whatever version is current,
version 0 in a fresh run), and the final version once the run finished. A pull that fails (a
follower down, the run moved on during the pull) is retried after :func:`retry_delay`, at the
then-current version: the evaluator skips to the newest rather than chasing a version the
followers no longer serve.

Which report: a finite, non-negative loss over at least one token, of a version the leader had
(0 ≤ version ≤ its version now), newer than the last one it recorded in the model's current
history (a repeated or older version is refused). Every refusal is
:class:`~dips.algo.refusal.Refused` ``INVALID_ARGUMENT`` naming the field and its value, and
changes nothing.

Rollbacks (§12): when the leader reconciles its followers to an older version t, the versions
above t are made again, with other content. The eval series is keyed by version, so a record
of such a version no longer describes the model that has that number now: the leader's
:class:`Lineage` forgets the records above t, and takes a report of version t + 1, t + 2, …
again (of t itself only if t was never recorded: its content did not change). The evaluator
sees its last version above the leader's (:meth:`Schedule.rolled_back`) and goes on from the
multiple of ``every`` at or below t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from dips.algo.refusal import Refusal, Refused

__all__ = ["EvalReport", "Lineage", "Schedule", "admit_report", "check_report", "due", "next_due",
           "perplexity", "record", "retry_delay", "tokens_at"]

#: The largest loss ``exp`` takes without overflow (nats/token); above it perplexity is +inf.
_EXP_MAX = 709.0


@dataclass(frozen=True)
class EvalReport:
    """One held-out evaluation (the ``ReportEval`` message of issue 15).

    Attributes:
        version: the version of the global model evaluated.
        eval_loss: mean next-token cross-entropy on the validation split (nats/token).
        eval_tokens: tokens predicted in the evaluation (tokens).
    """

    version: int
    eval_loss: float
    eval_tokens: int


def next_due(last: int | None, every: int) -> int:
    """The lowest version worth evaluating after version ``last`` (None: none evaluated yet,
    any version is): the next multiple of ``every`` (versions, >= 1) above ``last``.
    Raises ValueError for ``every`` < 1."""
    if every < 1:
        raise ValueError(f"every = {every}: must be >= 1 (versions)")
    return 0 if last is None else (last // every + 1) * every


def due(version: int, every: int, last: int | None, finished: bool = False) -> bool:
    """Whether the current ``version`` should be evaluated, the last one evaluated being
    ``last`` (None: none): it reached :func:`next_due`, or the run ``finished`` and its final
    version is not evaluated yet. Never a version at or below ``last`` (the same one again, or
    one the leader rolled back to). Raises ValueError for ``every`` < 1."""
    if last is not None and version <= last:
        return False
    return finished or version >= next_due(last, every)


def retry_delay(failures: int, base_s: float = 0.5, cap_s: float = 30.0) -> float:
    """Seconds to wait after the ``failures``-th failed pull in a row (>= 1): ``base_s``
    doubled per failure, at most ``cap_s``; 0 for no failure."""
    if failures <= 0:
        return 0.0
    return min(cap_s, base_s * 2.0 ** min(failures - 1, 30))


@dataclass
class Schedule:
    """The evaluator's state between looks at the leader (pure; ``now`` in seconds).

    Attributes:
        every: evaluate every this many versions (>= 1).
        last: the last version evaluated and reported (None: none yet).
        failures: failed pulls in a row since the last success.
        not_before: no pull before this time (seconds, the caller's clock).
    """

    every: int
    last: int | None = None
    failures: int = 0
    not_before: float = 0.0

    def __post_init__(self) -> None:
        next_due(None, self.every)  # raises ValueError for every < 1

    def target(self, version: int, finished: bool, ready: bool, now: float) -> int | None:
        """The version to pull now, or None: not :func:`due`, a follower not ready
        (``ready`` False: a pull would wait on a dead peer), or still backing off."""
        if not ready or now < self.not_before or not due(version, self.every, self.last,
                                                         finished):
            return None
        return version

    def done(self, version: int) -> None:
        """``version`` was evaluated and its report settled (accepted, or refused for good)."""
        self.last = version if self.last is None else max(self.last, version)
        self.failures, self.not_before = 0, 0.0

    def rolled_back(self, version: int) -> bool:
        """The leader's ``version`` is below the last one evaluated: it rolled back (§12),
        and the versions above ``version`` will be made again with other content. Goes on from
        the multiple of ``every`` at or below ``version`` (evaluated with the content it still
        has, or skipped); returns whether anything changed."""
        if self.last is None or version >= self.last:
            return False
        self.last = (max(version, 0) // self.every) * self.every
        return True

    def failed(self, now: float) -> float:
        """A pull (or report) failed at ``now``: back off; returns the delay (seconds)."""
        self.failures += 1
        delay = retry_delay(self.failures)
        self.not_before = now + delay
        return delay


@dataclass
class Lineage:
    """The recorded versions still in the model's history, as the leader knows it (see the
    module docstring: rollbacks). Pure; the leader keeps it in ``leader.json``.

    Attributes:
        versions: recorded versions, ascending, the newest :attr:`keep` of them.
        below: the highest version dropped from ``versions`` to keep it short (every dropped
            one is at or below it); None: none dropped.
        time: when the newest record was added (epoch s, the record's ``time``); None: none.
        keep: how many versions to keep (a rollback never reaches further back than the
            ledger's 64 versions of history).
    """

    versions: list[int] = field(default_factory=list)
    below: int | None = None
    time: float | None = None
    keep: int = 64

    def last(self) -> int | None:
        """The newest recorded version still in the history (None: none): a report must be
        of a newer one."""
        return self.versions[-1] if self.versions else self.below

    def add(self, version: int, time: float | None = None) -> None:
        """A record of ``version`` was written at ``time``."""
        while self.versions and self.versions[-1] >= version:
            self.versions.pop()
        self.versions.append(version)
        if len(self.versions) > self.keep:
            dropped, self.versions = self.versions[:-self.keep], self.versions[-self.keep:]
            self.below = max(dropped[-1], self.below if self.below is not None else -1)
        if time is not None:
            self.time = time

    def rolled_back(self, target: int) -> None:
        """The model went back to version ``target``: the records above it are forgotten.
        When that empties the list and a dropped record might be above ``target``, every
        version up to ``target`` counts as recorded (it cannot be told which were)."""
        while self.versions and self.versions[-1] > target:
            self.versions.pop()
        if not self.versions and self.below is not None and self.below > target:
            self.below = target

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (``leader.json``)."""
        return {"versions": list(self.versions), "below": self.below, "time": self.time}

    @classmethod
    def from_dict(cls, d: Any) -> "Lineage":
        """Inverse of :meth:`to_dict`. Raises ValueError naming the field and value."""
        if not isinstance(d, dict):
            raise ValueError(f"eval lineage = {str(d)[:60]!r}: not an object")
        versions = d.get("versions", [])
        if not isinstance(versions, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in versions) \
                or versions != sorted(set(versions)):
            raise ValueError(f"eval lineage field 'versions' = {str(versions)[:60]}: not "
                             "ascending versions >= 0")
        below, t = d.get("below"), d.get("time")
        if below is not None and (not isinstance(below, int) or isinstance(below, bool)):
            raise ValueError(f"eval lineage field 'below' = {below!r}: not a version")
        if t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool)):
            raise ValueError(f"eval lineage field 'time' = {t!r}: not epoch seconds")
        return cls(list(versions), below, None if t is None else float(t))


def perplexity(eval_loss: float) -> float:
    """exp(``eval_loss``) (loss in nats/token); +inf where it overflows (a diverged model)."""
    return math.exp(eval_loss) if eval_loss <= _EXP_MAX else math.inf


def _bad(field: str, value: Any, want: str) -> Refused:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:60] + "..."
    return Refused(Refusal.INVALID_ARGUMENT, f"ReportEval field {field!r} = {shown}: {want}")


def check_report(report: EvalReport) -> EvalReport:
    """``report`` if its fields are well formed on their own: ``version`` an int >= 0 (every
    version the leader ever had is), ``eval_loss`` a finite number >= 0 (nats/token),
    ``eval_tokens`` an int >= 1. Raises Refused(INVALID_ARGUMENT) naming the field and value."""
    v = report.version
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise _bad("version", v, "a version the leader never had (versions count from 0)")
    loss = report.eval_loss
    if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss) \
            or loss < 0:
        raise _bad("eval_loss", loss, "must be a finite number >= 0 (nats/token)")
    n = report.eval_tokens
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise _bad("eval_tokens", n, "must be an integer >= 1 (tokens evaluated)")
    return report


def admit_report(report: EvalReport, leader_version: int, last_reported: int | None) -> EvalReport:
    """``report`` if the leader takes it (see the module docstring), its version being
    ``leader_version`` now and the last version it recorded ``last_reported`` (None: none;
    after a rollback, :meth:`Lineage.last`).
    Raises Refused(INVALID_ARGUMENT) naming the field and value: a malformed field
    (:func:`check_report`), a version in the future (above ``leader_version``), a version
    repeated or older than the last one recorded."""
    check_report(report)
    if report.version > leader_version:
        raise _bad("version", report.version, f"in the future: the leader is at version "
                                              f"{leader_version}")
    if last_reported is not None and report.version <= last_reported:
        what = "repeated" if report.version == last_reported else "older than the last report"
        raise _bad("version", report.version, f"{what}: version {last_reported} is recorded "
                                              "already (one report per version, in order)")
    return report


def tokens_at(version: int, leader_version: int, tokens_now: int,
              stats: Mapping[int, tuple[int, int]]) -> int | None:
    """Tokens accepted into the model at ``version``: the leader's ``tokens_now`` (at
    ``leader_version``) less the tokens of every later version, ``stats`` being version ->
    (updates accepted, tokens accepted) of the recent versions. None when a later version is
    not in ``stats`` (older than the leader keeps) or ``version`` is ahead of the leader."""
    if version > leader_version:
        return None
    later = range(version + 1, leader_version + 1)
    if any(v not in stats for v in later):
        return None
    return max(0, tokens_now - sum(stats[v][1] for v in later))


def record(report: EvalReport, tokens_accepted: int | None, now: float) -> dict[str, Any]:
    """The leader's line of ``eval.jsonl`` for an admitted ``report`` at ``now`` (epoch
    seconds): ``time``, ``version``, ``tokens_accepted`` (tokens, null: unknown),
    ``eval_loss`` (nats/token), ``perplexity`` (null where it overflows), ``eval_tokens``."""
    ppl = perplexity(report.eval_loss)
    return {"time": round(now, 3), "version": report.version, "tokens_accepted": tokens_accepted,
            "eval_loss": report.eval_loss,
            "perplexity": ppl if math.isfinite(ppl) else None, "eval_tokens": report.eval_tokens}
