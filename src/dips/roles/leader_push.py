"""The leader's push path: admission into a grace window with a signed ticket, the §10
schedule, the verdict wait and the pull report (§6, §7, §10 of the seed; issue 13).

A mixin of :class:`dips.roles.leader.Leader` (which owns the lock ``self._cond``, the round
machine and the state); split out to keep each module small.

What a member claims is bounded before it reaches the round machine: T_j is the ledger's count
(or, without a ledger, the claim cut to ``cfg.max_push_tokens``), a base version must lie in
[0, the leader's version] and is raised to the lowest version the member can hold
(:func:`dips.algo.limits.push_base_version`), and every grant carries an admission ticket
(:mod:`dips.wire.admission`) naming its round, cluster, push id (a fresh nonce), T_j and base
version, signed under the followers' admission key: followers stage only what it names. A
waiting call ends as soon as its caller is gone (``cancelled``), so a member that gave up
holds no handler thread.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from typing import Any, Callable

from dips.algo import hold as hold_rules
from dips.algo.hold import Admission
from dips.algo.ledger import ChunkLedger, LedgerError
from dips.algo.limits import INT64_MAX, push_base_version, push_tokens
from dips.algo.refusal import Refusal, Refused
from dips.algo.round import (
    PullDone,
    PushReported,
    PushRequested,
    PushWithdrawn,
    step,
)
from dips.roles.leader_types import Grant, VerdictReply
from dips.wire import admission
from dips.wire.ratelog import RateLimitedLog

log = logging.getLogger(__name__)


class Pushes:
    """Push admission, verdicts and pull reports of the leader (see the module docstring)."""

    ledger: ChunkLedger | None

    def _init_pushes(self) -> None:
        """The push path's own state (called once by the leader's constructor): claims that
        the leader corrects are logged once a minute per member and kind (review 21, F3: one
        INFO line per refused request grew the log 109 to 195 KB/s)."""
        self._claims = RateLimitedLog(log, 60.0)

    def request_push(self, cluster_id: str, base_version: int, tokens: int, timeout_s: float,
                     progress: dict[int, int] | None = None,
                     expected_s: float | None = None,
                     cancelled: Callable[[], bool] | None = None) -> Grant:
        """Block until admitted into a grace window; returns the :class:`Grant` with its
        signed admission ticket (:mod:`dips.wire.admission`).

        With a ledger, T_j is the ledger's: the windows ``progress`` (chunk → window position
        reached) trained beyond the accepted positions, at most ``cfg.max_push_tokens`` worth
        (:meth:`dips.algo.ledger.ChunkLedger.credit`), × ``tokens_per_window``; ``tokens``,
        the client's own count, is only compared with it. Without one, ``tokens`` is cut to
        ``cfg.max_push_tokens`` (:func:`dips.algo.limits.push_tokens`). ``expected_s``: the
        push time the cluster predicts (seconds; serves until the leader measured its
        pushes). ``cancelled``: polled while waiting; true ends the wait (NOT_ADMITTED).
        Raises Refused: NOT_JOINED, RUN_FINISHED, NOT_READY (followers down or unreconciled),
        PUSH_IN_FLIGHT, INVALID_ARGUMENT (tokens not in [1, 2**63 - 1], a base version
        negative or ahead of the leader's: the cluster is then removed and must re-join),
        LEDGER_CONFLICT (a progress report the ledger
        refuses), NOTHING_TRAINED (no window since the last accepted push), NOT_ADMITTED (not
        admitted within ``timeout_s`` seconds).
        """
        for name, v, lo in (("tokens", tokens, 1), ("base_version", base_version, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= INT64_MAX:
                raise Refused(Refusal.INVALID_ARGUMENT, f"push field {name!r} = "
                                                        f"{str(v)[:40]} not in [{lo}, 2**63 - 1]")
        with self._cond:
            cluster = self._member(cluster_id)
            if base_version > self.version:
                # Its model is of a version this leader never decided (or rolled back when it
                # reconciled the followers): it must re-join and pull one complete model, so
                # its membership ends here and its next heartbeat tells it so.
                self._drop_cluster(cluster_id, f"push base version {base_version} is ahead "
                                               f"of version {self.version}")
                self.event("cluster_removed", cluster=cluster_id, base_version=base_version,
                           version=self.version)
                raise Refused(Refusal.INVALID_ARGUMENT, f"push field 'base_version' = "
                                                        f"{base_version} is ahead of the leader's "
                                                        f"version {self.version}: re-join")
            if self._state.finished:
                raise Refused(Refusal.RUN_FINISHED, f"the run finished ({self._state.finished}) "
                                                    f"at version {self.version}")
            if not self.ready:
                raise Refused(Refusal.NOT_READY, "followers not ready (down, missing or reconciling)")
            now = self._clock()
            self._sync_ready(now)
            believed = push_base_version(base_version, cluster.floor_version, self.version)
            if believed != base_version:
                self._claims.info((cluster_id, "base_version"), "cluster %s claimed base "
                                  "version %d below %d, the lowest it can hold: its staleness "
                                  "is counted from %d", cluster_id, base_version, believed,
                                  believed)
                base_version = believed
            if self.ledger is not None:
                per_push = (None if self.cfg.max_push_tokens is None else
                            self.cfg.max_push_tokens // max(self.tokens_per_window or 1, 1))
                try:
                    progress = self.ledger.credit(cluster_id, progress or {}, per_push)
                    windows = self.ledger.windows_in(cluster_id, progress)
                except LedgerError as exc:
                    raise Refused(Refusal.LEDGER_CONFLICT, str(exc)) from None
                if windows == 0:
                    raise Refused(Refusal.NOTHING_TRAINED, f"cluster {cluster_id!r}: no window "
                                                           "trained since its last accepted push")
                derived = windows * (self.tokens_per_window or 1)
                if derived != tokens:
                    self._claims.info((cluster_id, "tokens"), "cluster %s claimed T_j = %d, "
                                      "the ledger says %d", cluster_id, tokens, derived)
                tokens = derived
            else:
                tokens = push_tokens(tokens, self.cfg.max_push_tokens)
            push_id = secrets.token_hex(8)
            known = expected_s is not None and 0 < expected_s < math.inf
            state, actions = step(self._state, PushRequested(
                now, cluster_id, push_id, base_version, tokens,
                expected_s if known else None), self.policy)
            if self.ledger is not None:
                self.ledger.report(cluster_id, progress or {})
            self._carry(state, actions)
            if self.training_started_at is None:
                self.training_started_at = time.time()  # max_time_s counts from here
            deadline = now + timeout_s
            while True:  # the wait's decision: dips.algo.hold.admission (issue 16)
                what, slot, left = hold_rules.admission(self._state, cluster_id, push_id,
                                                        deadline, self._clock())
                if what is Admission.FINISHED:
                    raise Refused(Refusal.RUN_FINISHED, f"the run finished "
                                                        f"({self._state.finished}) before "
                                                        f"cluster {cluster_id!r}'s push")
                if what is Admission.DROPPED:
                    raise Refused(Refusal.NOT_ADMITTED, f"cluster {cluster_id!r}: push dropped "
                                                        "before admission (left or removed)")
                if what is Admission.ADMITTED:
                    return self._grant(slot, slot.round, cluster.stages)
                if what is Admission.SENT_AHEAD:  # sent ahead of any round
                    return self._grant(slot, 0, cluster.stages)
                if (what is Admission.WITHDRAW or self._stop.is_set()
                        or (cancelled is not None and cancelled())):
                    self._apply(PushWithdrawn(self._clock(), cluster_id, push_id))
                    if self.ledger is not None:
                        self.ledger.resolve(cluster_id, False)  # the report goes with it
                    raise Refused(Refusal.NOT_ADMITTED, f"cluster {cluster_id!r}: push not "
                                                        f"admitted in {timeout_s} s")
                self._cond.wait(min(left, 0.5))

    def _grant(self, slot: Any, rnd: int, stages: list[list[str]]) -> Grant:
        """The grant of ``slot`` admitted into round ``rnd`` (0: sent ahead of any round; it
        joins a round when the leader names its push id in ``Score``, so its ticket needs no
        round) with its ticket: what the followers stage for it (lock held)."""
        ticket = admission.Ticket(rnd, slot.cluster_id, slot.push_id, slot.tokens,
                                  slot.base_version)
        body, mac = admission.sign(admission.admission_key(self.issued.data_secret), ticket)
        return Grant(slot.push_id, rnd, self.version, self._schedule(rnd, stages),
                     stage_first=rnd == 0, ticket=body, ticket_mac=mac)

    def _schedule(self, rnd: int, stages: list[list[str]]) -> list[list[tuple[int, str, int]]]:
        """One cluster's §10 schedule ``[[(stage, layer, follower), ...], ...]`` for round
        ``rnd``: layers in model order (the stages' order), followers least recently used
        across the clusters already scheduled in this round and the rounds before
        (:class:`dips.algo.ScheduleBook`); other clusters' schedules are left as they are."""
        names = [l for s in stages for l in s]
        index = {l: i for i, l in enumerate(names)}
        worker_layers = [[index[l] for l in s] for s in stages]
        owner = {index[l]: self._layer_owner[l] for l in names}
        steps = self._book.schedule(rnd, worker_layers, owner, max(self.followers) + 1)
        return [[(t.worker, names[t.layer], t.follower) for t in step] for step in steps]

    def push_done(self, cluster_id: str, push_id: str, ok: bool, error: str,
                  timeout_s: float, cancelled: Callable[[], bool] | None = None) -> VerdictReply:
        """Report a push delivered (or failed); block until its round is decided.

        ``ok`` is the member's word: its push counts as delivered for its push-time estimate
        and for being sent ahead (:class:`dips.algo.round.RoundState`) only once the followers
        scored it complete (review 14, F2). A push already decided gets its verdict again (a client that lost the reply asks
        again). ``cancelled``: polled while waiting; true ends the wait (UNDECIDED).
        Raises Refused: UNKNOWN_PUSH (not in the current round and not decided),
        UNDECIDED (not decided within ``timeout_s`` seconds).
        """
        with self._cond:
            self._apply(PushReported(self._clock(), cluster_id, push_id, ok, error))
            start = self._clock()
            deadline = start + timeout_s
            while push_id not in self._state.verdicts:
                left = deadline - self._clock()
                if left <= 0 or self._stop.is_set() or (cancelled is not None and cancelled()):
                    waited = self._clock() - start  # the time waited, not the limit (review 34)
                    raise Refused(Refusal.UNDECIDED, f"push {push_id} of cluster {cluster_id!r} "
                                                     f"undecided after {waited:.1f} s")
                self._cond.wait(min(left, 0.5))
            verdict = self._state.verdicts[push_id]
            if verdict.cluster_id != cluster_id:
                raise Refused(Refusal.UNKNOWN_PUSH, f"push id {push_id!r} is not cluster "
                                                    f"{cluster_id!r}'s")
            return VerdictReply(verdict, self._holdings.get(push_id, []))

    def pull_done(self, cluster_id: str, version: int) -> None:
        """A cluster of the round pulled ``version`` (-1: it gave up; do not wait for it).
        Raises Refused: NOT_JOINED, INVALID_ARGUMENT (a version below -1, or above the
        leader's: no member can hold it; issue 13); nothing changes then."""
        with self._cond:
            c = self._member(cluster_id)
            if version < -1:
                raise Refused(Refusal.INVALID_ARGUMENT, f"pull field 'version' = {version} "
                                                        "must be >= -1")
            if version > self.version:
                raise Refused(Refusal.INVALID_ARGUMENT, f"pull field 'version' = {version} is "
                                                        f"ahead of the leader's {self.version}")
            if version >= 0:
                c.pulled_version = version
                c.floor_version = max(c.floor_version, version)
            self._apply(PullDone(self._clock(), cluster_id))

