"""The leader's durable records: decisions, verdicts, counts, the outer-step log, checkpoints
(§12 of the seed: the leader checkpoints only small metadata).

A mixin of :class:`dips.roles.leader.Leader` (which owns the lock ``self._cond``, the round
machine and the state); split out to keep each module small.

Exactly once (issue 10): when every follower has prepared an outer step, :meth:`_decide`
records, under the lock and before any follower commits, everything that follows from the
decision — the new version and penalty history, the counts of the round, the ledger's accepted
(and rejected) windows, each push's verdict with the ledger positions to continue from — in
``leader.json``, then writes the round's line of ``outer_steps.jsonl``. A leader that dies
after the first write resumes with all of it: it re-serves the verdicts by push id, the
round's pushes are neither lost nor counted twice, and it writes the line if it is missing.
A round with nothing accepted changes no follower and is recorded, in the same order, when
its update ends (:meth:`_settle`). So the records never claim a step (or a round's counts)
that the leader would not resume with (:meth:`_log_decision`; review 33 of issue 15, M1).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from dips.algo import grace as grace_rules
from dips.algo.faultlog import Fault
from dips.algo.ledger import ChunkLedger
from dips.algo.limits import INT64_MAX, saturating_add
from dips.algo.penalty import PenaltyState
from dips.algo.round import Decided, RoundEnded, RoundState, Verdict, verdicts_of
from dips.roles import failpoints
from dips.roles.leader_checkpoint import load_state, progress_of, progress_state, save_state
from dips.roles.leader_faults import STREAMS, RecentFaults
from dips.roles.leader_types import ClusterEntry
from dips.roles.outer_log import end_torn_line, last_decision_round, set_apart, withdrawn
from dips.roles.outer_step import UpdateReport

log = logging.getLogger(__name__)

#: Verdicts kept in ``leader.json`` (re-served by push id after a restart); a few KB.
VERDICTS_PERSISTED = 64
#: Round numbers reserved by one write of ``leader.json`` (see :meth:`Records.reserve_rounds`).
ROUND_BLOCK = 64


class Records:
    """Durable records of the leader (see the module docstring)."""

    ledger: ChunkLedger | None
    rounds_reserved: int
    _known_followers: dict[int, str]
    _joined: set[str]
    #: Called with (``"outer_steps"``, ``"leader_events"`` or ``"eval"``, record) for every
    #: record the leader writes (also without a run directory; ``"eval"``:
    #: :mod:`dips.roles.leader_eval`): the metrics of ``dips leader`` are fed
    #: from here. It runs on the writing thread, sometimes under the lock: it must be quick.
    observer: Callable[[str, dict[str, Any]], None] | None = None

    #: The decision line being written, carried by ``leader.json`` (:meth:`_log_decision`).
    _unlogged: dict[str, Any] | None = None
    _recent: RecentFaults | None = None
    _recent_lock = threading.Lock()

    def _faults(self) -> RecentFaults:
        """The faults of the last hour (made at the first record written, after reading the
        previous process's last hour back: before anything new is appended)."""
        if self._recent is None:
            with self._recent_lock:
                if self._recent is None:
                    self._recent = RecentFaults(self._run_dir, time.time())
        return self._recent

    def recent_faults(self, now: float) -> tuple[list[Fault], dict[tuple[str, str], int],
                                                  float]:
        """The faults the leader recorded in the hour before ``now`` (epoch s): (newest
        first, counts by (kind, reason), the window in seconds); ``GetStatus`` sends them."""
        return self._faults().recent(now)

    def _observe(self, stream: str, record: dict[str, Any]) -> None:
        """Hand ``record`` to the faults of the last hour and :attr:`observer` (one that
        fails is logged, never raised into the leader); a ``rollback`` line also goes to the
        held-out series' lineage (:mod:`dips.roles.leader_eval`)."""
        if stream in STREAMS:
            self._faults().note(stream, record)
            if stream == "outer_steps" and record.get("event") == "rollback":
                rolled_back = getattr(self, "eval_rolled_back", None)
                if rolled_back is not None:
                    rolled_back(int(record["version"]))
        if self.observer is None:
            return
        try:
            self.observer(stream, record)
        except Exception:
            log.exception("the observer failed on a %s record", stream)

    def reserve_rounds(self, above: int) -> None:
        """Reserve round numbers ``above + 1 .. above + ROUND_BLOCK`` durably before any is
        used: a leader restarted after a crash resumes above every reserved number, so no
        round number (and no admission ticket naming it) is used twice (issue 13: replay).
        One write per :data:`ROUND_BLOCK` rounds; numbers skipped by a restart are harmless
        (rounds only need to increase)."""
        with self._cond:
            self.rounds_reserved = max(self.rounds_reserved, above + ROUND_BLOCK)
            self.checkpoint()

    def _count(self, key: str, n: int) -> None:
        """Add ``n`` to count ``key``, saturating in [0, 2**63 - 1] (lock held): no claim can
        overflow a count or make ``GetStatus`` fail to encode it."""
        self.counts[key] = saturating_add(self.counts.get(key, 0), n)

    def _count_cluster(self, cluster: str, key: str, n: int) -> None:
        """Add ``n`` to cluster ``cluster``'s count ``key`` (``tokens_pushed`` or
        ``tokens_accepted``), saturating as :meth:`_count` (lock held)."""
        mine = self.cluster_counts.setdefault(cluster, {"tokens_pushed": 0, "tokens_accepted": 0})
        mine[key] = saturating_add(mine.get(key, 0), n)

    # ----- checkpoint and resume ---------------------------------------------------------
    def _resume(self, path: Path) -> None:
        state = load_state(path)
        if state is None:
            return
        self.version = state["version"]
        verdicts = {v["push_id"]: Verdict(**{k: v[k] for k in Verdict.__dataclass_fields__})
                    for v in state.get("verdicts", [])}
        self._holdings = {v["push_id"]: [tuple(h) for h in v.get("holdings", [])]
                          for v in state.get("verdicts", [])}
        # Measured push times survive a restart: a slow link's next push still goes ahead of
        # its round instead of holding the others' (found by a review: it did not).
        push_s = {str(c): float(x) for c, x in state.get("push_s", {}).items()}
        pull_s = {str(c): float(x) for c, x in state.get("pull_s", {}).items()}
        # So do the members sent ahead until they deliver complete pushes (review 14, F2;
        # review 17, C); an older leader.json lists them, each owing one.
        kept = state.get("send_ahead", {})
        send_ahead = ({str(c): max(int(n), 1) for c, n in kept.items()}
                      if isinstance(kept, dict) else {str(c): 1 for c in kept})
        stalls = {str(c): max(int(n), 0) for c, n in state.get("stalls", {}).items()}
        self._known_followers = {int(i): str(ep)
                                 for i, ep in (state.get("followers") or {}).items()}
        # Above every number the crashed incarnation reserved (and so may have granted).
        rounds = max(int(state["rounds"]), int(state.get("rounds_reserved", 0)))
        self.rounds_reserved = rounds
        self._state = RoundState(rounds=rounds, ready=False, verdicts=verdicts,
                                 grace=grace_rules.from_dict(state.get("grace", {})),
                                 push_s=push_s, pull_s=pull_s, send_ahead=send_ahead,
                                 stalls=stalls,
                                 finished=str(state.get("finished", "")))
        started = state.get("training_started_at")
        self.training_started_at = float(started) if started is not None else None
        # A count is a non-negative int64 whatever the file says (one written by an older
        # leader may hold a count that overflowed: issue 13).
        self.counts.update({str(k): min(max(int(v), 0), INT64_MAX)
                            for k, v in state["counts"].items()})
        self._count("restarts", 1)
        self.cluster_counts = {  # (an older leader.json has none: from 0)
            str(c): {k: min(max(int(v), 0), INT64_MAX) for k, v in kv.items()
                     if k in ("tokens_pushed", "tokens_accepted")}
            for c, kv in (state.get("cluster_counts") or {}).items() if isinstance(kv, dict)}
        self._version_cluster_tokens = {
            int(v): {str(c): int(t) for c, t in kv.items()}
            for v, kv in (state.get("version_cluster_tokens") or {}).items()}
        self.penalty = PenaltyState.from_dict(state["penalty"])
        self._version_stats = {int(v): (int(x[0]), int(x[1]))
                               for v, x in state.get("version_stats", {}).items()}
        # Members get a few extra intervals to find the restarted leader before removal.
        members = self.cfg.membership
        grace = self._clock() + 2 * members.missed_heartbeats * members.heartbeat_interval_s
        floors = state.get("floor_versions", {})
        progress = state.get("progress") or {}
        self.clusters = {c: ClusterEntry(c, stages, last_seen=grace,
                                         floor_version=min(int(floors.get(c, 0)), self.version),
                                         **progress_of(progress.get(c)))
                         for c, stages in state["clusters"].items()}
        # (an older leader.json lists no "joined": its members at least joined before)
        self._joined = {str(c) for c in state.get("joined", [])} | set(self.clusters)
        self._member_keys = {str(k): str(v) for k, v in state.get("member_keys", {}).items()}
        self._eval_lineage_saved = state.get("eval_lineage")  # read by _init_evals
        self._key_seq = int(state.get("key_seq", 0))
        if self.ledger is not None and state.get("ledger"):
            self.ledger = ChunkLedger.from_dict(state["ledger"])
            self.ledger.pending.clear()  # pushes in flight at the crash are lost
            for holder in self.ledger.holders() - set(self.clusters):
                self.ledger.release(holder)  # left while its last round was being decided
        for stream in ("outer_steps", "leader_events"):  # one the crash cut: lines stay whole
            end_torn_line(path.parent / f"{stream}.jsonl")
        self._log_unlogged(state.get("unlogged"))
        self.event("leader_resumed", version=self.version, rounds=self.rounds,
                   finished=self._state.finished)
        if self._state.finished:
            log.info("the run finished earlier (%s) at version %d: serving the final model "
                     "until stopped", self._state.finished, self.version)

    def checkpoint(self) -> None:
        """Write ``leader.json`` (metadata only; a few KB) atomically and durably. The write
        happens under the lock: checkpoints from several threads (one is taken as a round
        opens, inside the lock) land in the order of their snapshots, never interleaved."""
        if self._run_dir is None:
            return
        with self._cond:
            # The verdicts of a step decided but not yet finished (commits in flight) are
            # recorded too: a leader that dies now re-serves them after its restart.
            known = {**self._state.verdicts, **self._recorded}
            recent = list(known.values())[-VERDICTS_PERSISTED:]
            state = {"version": self.version, "rounds": self.rounds,
                     "rounds_reserved": self.rounds_reserved, "counts": dict(self.counts),
                     "finished": self._state.finished,
                     "training_started_at": self.training_started_at,
                     "penalty": self.penalty.to_dict(),
                     "clusters": {c.cluster_id: c.stages for c in self.clusters.values()},
                     "joined": sorted(self._joined),
                     "floor_versions": {c.cluster_id: c.floor_version
                                        for c in self.clusters.values()},
                     # What dips status shows of each until its next heartbeat and pull.
                     "progress": {c.cluster_id: progress_state(c)
                                  for c in self.clusters.values()},
                     "ledger": self.ledger.to_dict() if self.ledger else None,
                     "version_stats": {str(v): list(x) for v, x in self._version_stats.items()},
                     "cluster_counts": {c: dict(kv) for c, kv in self.cluster_counts.items()},
                     "version_cluster_tokens": {str(v): dict(kv) for v, kv
                                                in self._version_cluster_tokens.items()},
                     "grace": grace_rules.to_dict(self._state.grace),
                     "push_s": dict(self._state.push_s),
                     "pull_s": dict(self._state.pull_s),
                     "send_ahead": dict(sorted(self._state.send_ahead.items())),
                     "stalls": dict(sorted(self._state.stalls.items())),
                     # Where the followers are: a restarted leader takes their leases first.
                     "followers": {**{str(i): ep for i, ep in self._known_followers.items()},
                                   **{str(f.index): f.control_endpoint
                                      for f in self.followers.values()}},
                     # Members' data-plane key ids (not the keys): they stay valid after a
                     # restart, and a removed member's stays refused.
                     "member_keys": dict(self._member_keys), "key_seq": self._key_seq,
                     # Which held-out records still describe the model (rollbacks).
                     "eval_lineage": self._lineage_state(),
                     "verdicts": [{**asdict(v), "holdings": self._holdings.get(v.push_id, [])}
                                  for v in recent],
                     # The decision line being written (see _log_decision), if any.
                     "unlogged": self._unlogged}
            save_state(self._run_dir / "leader.json", state)

    def _lineage_state(self) -> dict[str, Any] | None:
        state = getattr(self, "eval_lineage_state", None)
        return state() if state is not None else None

    def event(self, kind: str, **extra: Any) -> None:
        """Append a timestamped event to ``leader_events.jsonl`` (and the log)."""
        # --log-format json: the event and its fields as JSON fields, not a repr in message
        log.info("%s %s", kind, extra, extra={"event": kind, "fields": extra})
        self._faults()  # the last hour read back before this line is appended
        record = {"time": time.time(), "event": kind, **extra}
        if self._run_dir is not None:
            with open(self._run_dir / "leader_events.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        self._observe("leader_events", record)

    # ----- decisions ----------------------------------------------------------------------
    def _decide(self, number: int, report: UpdateReport) -> None:
        """Record a decided outer step (every follower prepared it) durably, before commits
        (see the module docstring)."""
        with self._cond:
            rnd = self._state.current
            if rnd is None or rnd.number != number:
                raise RuntimeError(f"round {number} decided while the machine holds "
                                   f"{rnd.number if rnd else None}")
            out = report.outcome
            self.version, self.penalty = out.version, report.penalty
            tokens = sum(report.tokens[c] for c in out.accepted)
            self._count("outer_steps", 1)
            self._count("updates_accepted", len(out.accepted))
            self._count("tokens_accepted", tokens)
            self._version_stats[out.version] = (len(out.accepted), tokens)
            for v in sorted(self._version_stats)[:-64]:
                del self._version_stats[v]
            self._version_cluster_tokens[out.version] = {c: report.tokens[c] for c in out.accepted}
            for v in sorted(self._version_cluster_tokens)[:-64]:
                del self._version_cluster_tokens[v]
            for c in out.accepted:
                self._count_cluster(c, "tokens_accepted", report.tokens[c])
            verdicts = verdicts_of(rnd, out)
            self._account(verdicts, report, out.version)
            self._recorded = {v.push_id: v for v in verdicts}
            self._decided = number
            self._log_decision(number, report, rnd)

    def _settle(self, decided: Decided) -> None:
        """The verdicts of a round are out (lock held): record a round that was not decided
        durably (nothing accepted, or failed: ``leader.json`` with its counts, then its line),
        release members that left meanwhile."""
        if self._decided != decided.number:
            report = self._reports[decided.number]
            self._account(decided.verdicts, report, None)
            self._log_decision(decided.number, report, decided.rnd)
        for c in sorted(self._leaving):
            if self.ledger is not None and c not in self.clusters:  # (not re-joined meanwhile)
                self.ledger.release(c)
        self._leaving.clear()

    def _account(self, verdicts: tuple[Verdict, ...], report: UpdateReport,
                 version: int | None) -> None:
        """Counts, ledger and positions of a round's verdicts (lock held); a push withdrawn
        by leaving the finished run (:func:`withdrawn`) counts nowhere."""
        gone = withdrawn(report)
        counted = [v for v in verdicts if v.cluster_id not in gone]
        tokens = {c: t for c, t in report.tokens.items() if c not in gone}
        self._count("updates_pushed", len(counted))
        self._count("updates_rejected", sum(not v.accepted for v in counted))
        self._count("tokens_pushed", sum(tokens.values()))
        for c, t in tokens.items():
            self._count_cluster(c, "tokens_pushed", t)
        for v in verdicts:
            holdings: list[tuple[int, int]] = []
            if self.ledger is not None:
                self.ledger.resolve(v.cluster_id, v.accepted, version)
                holdings = self.ledger.holdings(v.cluster_id)
            self._holdings[v.push_id] = holdings
            if v.cluster_id in self.clusters:
                entry = self.clusters[v.cluster_id]
                entry.last_push = "accepted" if v.accepted else "rejected"
                entry.floor_version = max(entry.floor_version, v.version)  # it pulls v.version
        known = set(self._state.verdicts) | {v.push_id for v in verdicts}
        for pid in [p for p in self._holdings if p not in known]:
            del self._holdings[pid]

    # ----- the outer-step log ---------------------------------------------------------------
    def _log_decision(self, number: int, report: UpdateReport, rnd: Any) -> None:
        """The round's line of ``outer_steps.jsonl`` (lock held), after ``leader.json``: the
        checkpoint, which carries the line as ``unlogged``, is made durable first, then the
        line is written and flushed to disk. The records never claim a step (or a round's
        counts) that a restarted leader does not hold: a leader that dies between the two
        writes resumes with the round, and :meth:`_resume` writes its missing line (review
        33 of issue 15, M1: the other order left a phantom step in the log, counted by the
        summary, the report and the metrics, that the resumed leader did not hold)."""
        record = set_apart(report.record(number), withdrawn(report))
        if rnd is not None:
            end = rnd.update_done if rnd.update_done is not None else self._clock()
            record.update(window_s=round(rnd.closes_at - rnd.opened_at, 4),
                          push_s=round(rnd.update_started - rnd.closes_at, 4),
                          update_s=round(end - rnd.update_started, 4))
        record.update(time=time.time())
        self._unlogged = record
        self.checkpoint()
        failpoints.hit("decided")  # fault injection: leader.json written, its line not yet
        self._write(record, durable=True)
        self._unlogged = None

    def _log_unlogged(self, record: Any) -> None:
        """Write the decision line ``leader.json`` carried (a previous incarnation died
        before writing it), unless ``outer_steps.jsonl`` has it already."""
        if self._run_dir is None or not isinstance(record, dict):
            return
        last = last_decision_round(self._run_dir / "outer_steps.jsonl")
        if last is None or last < int(record.get("round", 0)):
            log.warning("writing the decision line of round %s, which the previous leader "
                        "recorded in leader.json but did not write", record.get("round"))
            self._write(record, durable=True)

    def _log_round(self, ended: RoundEnded) -> None:
        """The round-end line of ``outer_steps.jsonl`` (commits, pulls, §7 estimates)."""
        with self._cond:
            report = self._reports.pop(ended.number, None)
        self._write({"event": "round_end", "round": ended.number,
                     "version": report.outcome.version if report else self.version,
                     "commit_failed": report.commit_failed if report else [],
                     "window_s": round(ended.window_s, 4), "push_s": round(ended.push_s, 4),
                     "update_s": round(ended.update_s, 4), "pull_s": round(ended.pull_s, 4),
                     "grace": dict(ended.grace), "time": time.time()})
        self.checkpoint()

    def _write(self, record: dict[str, Any], durable: bool = False) -> None:
        self._faults()  # the last hour read back before this line is appended
        if self._run_dir is not None:
            with open(self._run_dir / "outer_steps.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
        self._observe("outer_steps", record)


