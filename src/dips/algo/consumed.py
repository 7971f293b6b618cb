"""Tokens a cluster consumed, over every process it ran as, from its ``train.jsonl`` records.

One rule, used by the launcher's ``summary.json`` (:func:`dips.emu.summary.tokens_consumed`)
and by ``dips report``'s loss-against-tokens and tokens-per-cluster plots, so the two always
agree (review of issue 15: the report once counted a resumed cluster's saved tokens twice).

A cluster's ``train.jsonl`` holds, per process of the cluster: a ``join`` record, a ``resume``
record when the process resumed the inner state an earlier one saved at a pull (issue 14:
``steps`` and ``tokens``, the counters at that pull), then one record per inner step with the
process's cumulative ``tokens`` and its ``step`` number. So:

* a fresh process counts ``tokens`` (and ``step``) from 0 again: a count that falls back, or a
  step number that does not grow, starts a new process, which adds what it counts;
* a resumed process counts on from the saved ``tokens``, which an earlier process trained and
  counted already: only what it counts beyond them is new. The steps an earlier process
  trained after that save (before it died) were trained, so they count too: each step record
  counts once, whichever process wrote it; no token is counted twice;
* a ``join`` record with ``rejoin: true`` is a later join of the same process (removed for
  missed heartbeats, the leader restarted without it): its counts go on, no new process;
* a step whose sync follows it has its line written after that sync, and a ``sync_start``
  record (``inner_step``, ``tokens``) before it: a process killed in the middle of the sync
  (its push or pull) leaves only the ``sync_start``, which counts the step; the step's own
  line, when it comes, counts nothing more (review 33 of issue 15, m5: a cluster killed in a
  pull was 256 tokens short).

Pure: records in, numbers out (tokens; a record's fields of another type are skipped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

__all__ = ["StepTokens", "consumed_series", "tokens_consumed_of", "trained_at_least"]


@dataclass(frozen=True)
class StepTokens:
    """One inner-step record's place in the cluster's count.

    Attributes:
        index: the record's position in the records given (0-based).
        tokens: tokens the cluster consumed through this step, over every process so far.
        process: which process of the cluster wrote it (0 for the first; a ``join``, a
            ``resume`` or a count that starts again makes a new one).
    """

    index: int
    tokens: int
    process: int


def _int(rec: dict[str, Any], key: str) -> int | None:
    v = rec.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


class _Count:
    """The running count of :func:`consumed_series` (tokens)."""

    def __init__(self) -> None:
        self.total = 0  # tokens of the processes before this one, beyond their bases
        self.last = 0  # this process's last cumulative count
        self.base = 0  # the count this process started from (a resumed one: the saved count)
        self.last_step = 0
        self.process = 0
        self.started = False  # a step of the current process was seen
        self.pending = False  # a join/resume seen: the next step belongs to a new process

    def close(self) -> None:
        """The current process ended: what it counted beyond its base is added."""
        self.total += self.last - self.base

    def new_process(self) -> None:
        if self.started:
            self.process += 1
        self.started = False

    def now(self) -> int:
        return self.total + self.last - self.base

    def step(self, tokens: int, step: int | None) -> None:
        """Count an inner step whose cumulative count is ``tokens`` (step number ``step``)."""
        if tokens < self.last or (step is not None and step <= self.last_step):
            self.close()  # a fresh process: its counts start again from 0
            self.base = 0
            self.new_process()
        elif self.pending:
            self.new_process()  # a join and a count that goes on: a new process all the same
        self.pending = False
        self.last = tokens
        self.last_step = step if step is not None else self.last_step
        self.started = True


def _fold(records: Iterable[dict[str, Any]]) -> tuple[list[StepTokens], int]:
    """(:func:`consumed_series`, the tokens consumed in all)."""
    c = _Count()
    out: list[StepTokens] = []
    marked: tuple[int | None, int] | None = None  # (step, tokens) a sync_start counted
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            continue
        event = rec.get("event")
        seen, marked = marked, None
        if event == "join" and rec.get("rejoin") is True:
            marked = seen  # the same process joined again: its counts go on
            continue
        if event == "join":
            c.pending = True
            continue
        if event == "resume" and (saved := _int(rec, "tokens")) is not None:
            c.close()
            c.base = c.last = saved
            c.last_step = _int(rec, "steps") or 0
            c.new_process()
            c.pending = False
            continue
        if event == "sync_start" and (tokens := _int(rec, "tokens")) is not None:
            step = _int(rec, "inner_step")
            c.step(tokens, step)
            marked = (step, tokens)
            continue
        tokens, step = _int(rec, "tokens"), _int(rec, "step")
        if tokens is None or event is not None:
            marked = seen  # (a record between them, e.g. a hold's: the mark still holds)
            continue
        if seen != (step, tokens):  # else the step its sync_start counted already
            c.step(tokens, step)
        out.append(StepTokens(i, c.now(), c.process))
    return out, c.now()


def consumed_series(records: Iterable[dict[str, Any]]) -> list[StepTokens]:
    """Every inner-step record (one with an int ``tokens``) of a cluster's ``train.jsonl``
    with the tokens consumed through it (module docstring); events (a ``sync_start`` counts,
    but is not listed) and records without a count are left out."""
    return _fold(records)[0]


def tokens_consumed_of(records: Iterable[dict[str, Any]]) -> int:
    """Tokens a cluster consumed over every process it ran as (module docstring)."""
    return _fold(records)[1]


def trained_at_least(counted: int, pushed: int) -> int:
    """Tokens a cluster trained, at least: what it ``counted`` (its ``train.jsonl``, or its
    last heartbeat), never below the tokens the leader saw it ``pushed`` (every token a push
    carried was trained), so never below its tokens accepted either: a count that lags (a
    heartbeat sent before the push, a process killed before its step's line) does not show
    less trained than accepted (review 33 of issue 15, m1). One rule for ``summary.json``
    and ``dips status``."""
    return max(int(counted), int(pushed))
