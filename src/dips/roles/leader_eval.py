"""The leader's record of the global model's held-out loss (issue 15): ``eval.jsonl``.

A mixin of :class:`dips.roles.leader.Leader` (which owns the lock ``self._cond``, the version,
the counts and the recent versions' stats); split out to keep each module small.

``dips evaluate`` (the operator's identity) reports the held-out loss of a version it pulled
from the followers (``ReportEval``); :meth:`EvalReports.report_eval` checks it against the
leader's state (:func:`dips.algo.evaluation.admit_report`: a finite loss, a version the leader
had, not in the future, newer than the last one recorded), adds the tokens accepted into the
model at that version, and appends one JSON line to ``eval.jsonl`` in the state directory,
fsynced before the call returns (:func:`dips.roles.durable.append_durable`)::

    {"time": 1767000000.123, "version": 8, "tokens_accepted": 16384, "eval_loss": 5.91,
     "perplexity": 368.7, "eval_tokens": 4032}

(``time`` epoch seconds, ``tokens_accepted`` tokens or null when older than the versions the
leader keeps stats of, ``eval_loss`` nats/token, ``perplexity`` exp(loss) or null where it
overflows, ``eval_tokens`` tokens evaluated). The record then goes to the leader's observer
(stream ``"eval"``: the ``dips_heldout_*`` metrics) and :meth:`EvalReports.last_eval` (the
``GetStatus`` reply, ``dips status``). A refused report changes nothing. A restarted leader
reads its last record back, so a repeated version stays refused across restarts; a line cut
by a crash is dropped (the file is rewritten without it) before anything is appended.

After a rollback (the ``rollback`` line of ``outer_steps.jsonl``: followers reconciled to an
older version t) the versions above t are made again with other content: the leader forgets
its records above t (:class:`dips.algo.evaluation.Lineage`, kept in ``leader.json``) and takes
reports of them again, so the series does not stop until the version climbs past the last
one reported.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from dips.algo.evaluation import EvalReport, Lineage, admit_report, record, tokens_at
from dips.roles.durable import append_durable, write_atomic

log = logging.getLogger(__name__)

#: The file in the leader's state directory (``dips report`` finds it by this name).
EVAL_FILE = "eval.jsonl"


def last_record(path: Path) -> dict[str, Any] | None:
    """The last complete record of ``path`` (a line that is a JSON object with an integer
    ``version``), or None. A last line cut by a crash (no newline at its end) is removed from
    the file first, so the next append starts on a line of its own. Raises OSError."""
    if not path.exists():
        return None
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        raw = raw[: raw.rfind(b"\n") + 1]
        write_atomic(path, raw)
    for line in reversed(raw.decode("utf-8", errors="replace").splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("version"), int):
            return rec
    return None


class EvalReports:
    """Held-out reports of the leader (see the module docstring)."""

    _cond: threading.Condition
    _run_dir: Path | None
    version: int
    counts: dict[str, int]
    _version_stats: dict[int, tuple[int, int]]
    _observe: Callable[[str, dict[str, Any]], None]
    checkpoint: Callable[[], None]

    def _init_evals(self) -> None:
        """Read the last record of ``eval.jsonl`` (if any) back: call once, in ``__init__``."""
        self._eval_lock = threading.Lock()  # one report at a time: check, append, remember
        self._eval_suspect = False          # an append failed: repair the file first
        self._eval_last = (last_record(self._run_dir / EVAL_FILE)
                           if self._run_dir is not None else None)
        self._lineage_lock = threading.Lock()  # held alone: a rollback may come on any thread
        saved = getattr(self, "_eval_lineage_saved", None)  # from leader.json (_resume)
        lineage = Lineage()
        if saved is not None:
            try:
                lineage = Lineage.from_dict(saved)
            except ValueError as exc:
                log.warning("leader.json: %s; going on from the last record of %s", exc, EVAL_FILE)
                saved = None
        last = self._eval_last
        if last is not None and (saved is None or lineage.time is None
                                 or float(last.get("time", 0.0)) > lineage.time):
            lineage.add(last["version"], float(last.get("time", 0.0)))  # not checkpointed yet
        self._eval_lineage = lineage

    def eval_lineage_state(self) -> dict[str, Any] | None:
        """The lineage of the held-out records for ``leader.json`` (None before init)."""
        lineage = getattr(self, "_eval_lineage", None)
        if lineage is None:
            return None
        with self._lineage_lock:
            return lineage.to_dict()

    def eval_rolled_back(self, target: int) -> None:
        """The followers were reconciled to version ``target``: forget the records above it."""
        lineage = getattr(self, "_eval_lineage", None)
        if lineage is not None:
            with self._lineage_lock:
                lineage.rolled_back(target)

    def last_eval(self) -> dict[str, Any] | None:
        """The last held-out record accepted (a copy; None: none yet)."""
        rec = self._eval_last
        return dict(rec) if rec is not None else None

    def report_eval(self, report: EvalReport, now: float | None = None) -> dict[str, Any]:
        """Record ``report`` (from the operator's identity: the servicer checks the caller)
        at ``now`` (epoch seconds; default: the wall clock); returns the record written.

        Raises:
            Refused: INVALID_ARGUMENT naming the field and value
                (:func:`dips.algo.evaluation.admit_report`); nothing is written then.
            OSError: ``eval.jsonl`` could not be written (the report is not recorded: the
                evaluator retries it).
        """
        with self._eval_lock:
            with self._cond:
                version, tokens_now = self.version, self.counts.get("tokens_accepted", 0)
                tokens = tokens_at(report.version, version, tokens_now, self._version_stats)
            with self._lineage_lock:
                last = self._eval_lineage.last()
            admit_report(report, version, last)
            rec = record(report, tokens, time.time() if now is None else now)
            if self._run_dir is not None:
                self._append(self._run_dir / EVAL_FILE, rec)
            self._eval_last = rec
            with self._lineage_lock:
                self._eval_lineage.add(rec["version"], rec["time"])
        self.checkpoint()  # the lineage, so a restart knows which records still count
        log.info("held-out loss of version %d: %.4f nats/token (%d tokens accepted)",
                 rec["version"], rec["eval_loss"], -1 if tokens is None else tokens)
        self._observe("eval", rec)
        return dict(rec)

    def _append(self, path: Path, rec: dict[str, Any]) -> None:
        """One line, fsynced (eval lock held); after a failed append the file is repaired
        (its cut line dropped) before the next one."""
        try:
            if self._eval_suspect:
                last_record(path)
                self._eval_suspect = False
            append_durable(path, (json.dumps(rec) + "\n").encode())
        except OSError:
            self._eval_suspect = True
            raise
