"""The leader's membership: followers and clusters joining, heartbeating, leaving, being
removed after missed heartbeats (§12), and data-chunk leases from the ledger.

A mixin of :class:`dips.roles.leader.Leader` (which owns the lock ``self._cond``, the round
machine and the state); split out to keep each module small. A cluster that leaves or is
removed is a :class:`dips.algo.round.MemberGone` event of the round machine.
"""

from __future__ import annotations

import logging
import math
import time

from dips.algo.ledger import ChunkLedger
from dips.algo.limits import INT64_MAX, JoinHistory, join_allowed, lease_allowed
from dips.algo.liveness import OwnLag, silent_s, ticked
from dips.algo.refusal import Refusal, Refused
from dips.algo.round import MemberGone, Phase, RejectCode
from dips.roles.leader_types import (
    ClusterEntry,
    FollowerEntry,
    HeartbeatAnswer,
    RegisterAnswer,
)
from dips.spec.fingerprint import mismatch
from dips.wire import keys
from dips.wire.keys import MemberKey
from dips.wire.ratelog import RateLimitedLog
from dips.wire.pki import Identity

log = logging.getLogger(__name__)

#: Observers (the operator's final pulls, evaluators) whose keys are kept at once.
OBSERVER_KEYS = 4
#: The largest training loss a heartbeat shows (nats; a cross-entropy is >= 0, and ln of a
#: 10^6-token vocabulary is 13.8): what a member says of itself is display only.
MAX_SHOWN_LOSS = 1e6


class Membership:
    """Membership methods of the leader (see the module docstring)."""

    ledger: ChunkLedger | None

    def _init_membership(self) -> None:
        """The membership's own state (called once by the leader's constructor)."""
        self._joins: dict[str, JoinHistory] = {}  # cluster -> its joins (re-join backoff)
        self._joined: set[str] = set()  # every cluster that joined this run (leader.json)
        self._lag = OwnLag()  # the monitor's own ticks and stalls (dips.algo.liveness),
        # timed by the clock its thread is scheduled by; a leader on an injected clock (a
        # test's, moved by hand) has no lag of its own to measure on it.
        self._tick_clock = time.monotonic if self._clock is time.monotonic else None
        self._stalls = RateLimitedLog(log, 60.0)  # one line a minute of the leader's stalls
        self._waiting = RateLimitedLog(log, 10.0)  # and one per 10 s of followers missing

    def register_follower(self, entry: FollowerEntry) -> RegisterAnswer:
        """Add a follower or refresh its heartbeat. A new incarnation (restart) or a follower
        that was down triggers reconciliation. A follower that already follows a higher
        leader term makes this leader step down (Refused STALE_TERM). Returns this leader's
        term and the data secret. Raises ValueError on overlapping layers.

        A follower whose data plane stopped serving says why (``data_plane_error``): it is
        marked down (not up, reconcile needed, event ``follower_down``) for as long as it says
        so, since its heartbeats alone would keep it believed to serve; the keys in the
        answer still go to it. A restart (new incarnation) brings it back up."""
        if entry.leader_term > self.term:
            self.step_down(f"follower {entry.index} follows leader term {entry.leader_term} > "
                           f"{self.term}")
            raise Refused(Refusal.STALE_TERM, f"leader term {self.term} stepped down: follower "
                                              f"{entry.index} follows term {entry.leader_term}")
        with self._cond:
            answer = RegisterAnswer(self.term, self.issued.data_secret, self.issued.encrypt,
                                    tuple(self._member_keys.values()), self._key_seq)
            for f in self.followers.values():
                if f.index != entry.index and set(f.layers) & set(entry.layers):
                    raise ValueError(f"follower {entry.index}: layers "
                                     f"{sorted(set(f.layers) & set(entry.layers))} already owned "
                                     f"by follower {f.index}")
            old = self.followers.get(entry.index)
            broken = entry.data_plane_error[:200]
            if old is not None and old.incarnation == entry.incarnation and (old.up or broken):
                old.last_seen, old.version = self._clock(), entry.version  # (dips status)
                if not (old.up and broken):
                    return answer  # a heartbeat; or down already for it: one event, not one each
                old.up = False
                self.followers_epoch += 1  # clusters abort transfers to it
                self.needs_reconcile = True
                self._sync_ready(self._clock())
            else:
                gone = self._superseded.setdefault(entry.index, [])
                if entry.incarnation in gone:
                    # The process this one replaced is still alive (one identity, two
                    # processes): the newer process serves the index, the older one is told
                    # to stop.
                    raise Refused(Refusal.FORBIDDEN, f"follower {entry.index}: incarnation "
                                                     f"{entry.incarnation} was superseded by "
                                                     "another process serving this index")
                if old is not None and old.incarnation != entry.incarnation:
                    gone[:] = [*gone[-15:], old.incarnation]
                entry.control = self._connect(entry)
                entry.last_seen = self._clock()
                entry.up = not broken
                self.followers[entry.index] = entry
                self.followers_epoch += 1  # clusters abort transfers to the old incarnation
                self._layer_owner = {l: f.index for f in self.followers.values() for l in f.layers}
                self.needs_reconcile = True
                self._sync_ready(self._clock())
        if broken:
            self.event("follower_down", follower=entry.index, cause="data plane", error=broken)
        else:
            self.event("follower_up", follower=entry.index, incarnation=entry.incarnation,
                       restarted=old is not None and old.incarnation != entry.incarnation)
        return answer

    def spec_json(self) -> tuple[str, str]:
        """(run spec JSON, model fingerprint JSON) this leader serves."""
        return self.issued.run_spec, self.issued.fingerprint

    def _key(self, identity: Identity) -> MemberKey:
        """A new data-plane key for ``identity``, which replaces its previous one (lock
        held). An observer's key is kept among the last few observers' (``admin#n``)."""
        key = keys.issue(self.issued.data_secret, identity, self.issued.encrypt, self._key_seq)
        self._key_seq += 1
        slot = identity.name
        if identity.role == "admin":
            slot = f"{identity.name}#{self._key_seq % OBSERVER_KEYS}"
        self._member_keys[slot] = key.key_id
        return key

    def join_observer(self, name: str) -> tuple[int, list[FollowerEntry], MemberKey]:
        """An observer (the operator's identity ``name``, e.g. a final pull or an evaluator):
        the version, the followers and a pull-only data-plane key; no membership. Raises
        Refused(NOT_READY) while followers are missing."""
        with self._cond:
            if len(self.followers) < self.cfg.followers:
                raise Refused(Refusal.NOT_READY, f"{len(self.followers)}/{self.cfg.followers} "
                                                 "followers registered")
            version, followers = self.version, list(self.followers.values())
            return version, followers, self._key(Identity.parse(name))

    def follower_list(self) -> list[FollowerEntry]:
        with self._cond:
            return [self.followers[i] for i in sorted(self.followers)]

    @property
    def ready(self) -> bool:
        """Every follower registered, up, and reconciled to one version."""
        return (len(self.followers) == self.cfg.followers and not self.needs_reconcile
                and all(f.up for f in self.followers.values()))

    def join_cluster(self, cluster_id: str, stages: list[list[str]],
                     fingerprint: str = "") -> tuple[int, list[FollowerEntry], MemberKey]:
        """Admit (or re-admit) a cluster whose stage workers own ``stages`` (layer keys) and
        whose model has ``fingerprint`` (JSON; checked when this leader has one).

        A re-joining cluster lost its local state: its chunks return to the ledger. Returns
        the current version, the followers to pull from and the cluster's new data-plane
        key. Raises ValueError if the stages do not cover every layer exactly once or the id
        is empty; Refused(MODEL_MISMATCH) naming the differing fields; Refused(NOT_READY)
        while followers are missing; Refused(RUN_FINISHED) once the run ended; Refused(BUSY)
        when it joins too often (:func:`dips.algo.limits.join_allowed`).

        The join rate limit counts every attempt that passes the cheap checks, refused ones
        included, *before* the fingerprint is read (review 21, F2: a malformed fingerprint
        cost seconds of the leader's GIL each, ahead of the limit), and the fingerprint's
        check is bounded work (:func:`dips.spec.fingerprint.mismatch`), done outside the lock.
        """
        if not cluster_id:
            raise ValueError("join field 'cluster_id' is empty")
        with self._cond:
            self._may_join(cluster_id, stages)
        if self.issued.fingerprint:
            diff = mismatch(self.issued.fingerprint, fingerprint)
            if diff:
                raise Refused(Refusal.MODEL_MISMATCH, f"cluster {cluster_id!r}: its model does "
                                                      f"not match the run's: {diff}")
        with self._cond:
            if self._state.finished:
                raise Refused(Refusal.RUN_FINISHED, f"the run finished ({self._state.finished}) "
                                                    f"at version {self.version}")
            # A re-join: this id joined the run before, in this leader or an earlier one,
            # whether it is still a member (its process restarted fast) or was removed.
            rejoin = cluster_id in self.clusters or cluster_id in self._joined
            self._joined.add(cluster_id)
            self._drop_cluster(cluster_id, "cluster re-joined")
            self.clusters[cluster_id] = ClusterEntry(cluster_id, stages, last_seen=self._clock(),
                                                     floor_version=self.version)
            version, followers = self.version, list(self.followers.values())
            key = self._key(Identity.cluster(cluster_id))
        self.event("cluster_joined", cluster=cluster_id, rejoin=rejoin, version=version)
        if not rejoin:
            self.checkpoint()  # its first join: a restarted leader still calls the next a re-join
        return version, followers, key

    def _may_join(self, cluster_id: str, stages: list[list[str]]) -> None:
        """The cheap checks of a join, and its place in the join rate limit (lock held):
        raises as :meth:`join_cluster` does; on return the attempt is counted."""
        if self._state.finished:
            raise Refused(Refusal.RUN_FINISHED, f"the run finished ({self._state.finished}) "
                                                f"at version {self.version}")
        if len(self.followers) < self.cfg.followers:
            raise Refused(Refusal.NOT_READY, f"{len(self.followers)}/{self.cfg.followers} "
                                             "followers registered")
        if down := sorted(f.index for f in self.followers.values() if not f.up):
            # Its pull would wait on a follower known down (review 28 of issue 15, #3: 10 s
            # of nothing trained); refused at once, the cluster joins again once it is back.
            raise Refused(Refusal.NOT_READY, f"follower(s) {down} down: join again once back")
        flat = [l for s in stages for l in s]
        if sorted(flat) != sorted(self._layer_owner) or len(flat) != len(set(flat)):
            raise ValueError(f"cluster {cluster_id!r}: stage layers {flat} do not cover the "
                             f"model's layers {sorted(self._layer_owner)} exactly once")
        members = self.cfg.membership
        wait, joins = join_allowed(self._joins.get(cluster_id), self._clock(),
                                   members.rejoin_min_s, members.rejoin_max_s)
        if wait > 0:
            raise Refused(Refusal.BUSY, f"cluster {cluster_id!r} joined "
                                        f"{joins[1] + 1} times in a row: it may join "
                                        f"again in {wait:.1f} s "
                                        "(membership.rejoin_min_s)")
        self._joins[cluster_id] = joins

    def heartbeat(self, cluster_id: str, inner_step: int, tokens: int,
                  loss: float | None) -> HeartbeatAnswer:
        """Record a cluster's progress (its own report, shown in the status only: it never
        counts toward the token budget, which counts accepted tokens). Counts are clamped to
        [0, 2**63 - 1]; a loss that is None, negative or not finite leaves the last one
        shown, a larger one than :data:`MAX_SHOWN_LOSS` is shown as that. Unknown
        cluster: ``known`` is False and it must re-join."""
        with self._cond:
            c = self.clusters.get(cluster_id)
            if c is not None:
                c.inner_step = min(max(int(inner_step), 0), INT64_MAX)
                c.tokens = min(max(int(tokens), 0), INT64_MAX)
                if loss is not None and math.isfinite(loss) and loss >= 0:
                    c.last_loss = min(float(loss), MAX_SHOWN_LOSS)
                c.last_seen = self._clock()
                if self.ledger is not None:
                    self.ledger.observe(c.last_seen)  # times accepted progress (review 14, F3)
            return HeartbeatAnswer(self.version, c is not None, self.followers_epoch,
                                   self._state.finished)

    def leave(self, cluster_id: str) -> None:
        """A graceful leave: like a removal, its chunks return to the ledger."""
        with self._cond:
            known = self._drop_cluster(cluster_id, withdrawn=True)
        if known:
            self.event("cluster_left", cluster=cluster_id)
            self.checkpoint()  # its chunks are back: a restart must not count them again

    def _drop_cluster(self, cluster_id: str, reason: str = "cluster left",
                      withdrawn: bool = False) -> bool:
        """Remove a cluster (lock held): for the round machine its queued request dropped, its
        push in the current round failed and no longer awaited; its data chunks go back to
        the ledger. A push already in the update phase cannot be taken back from followers
        that may have prepared it: its chunks are released only once the round's verdicts are
        out, so its windows are either credited or handed out again, never both.
        Its push in the round is ``withdrawn`` (a graceful leave), or removed after the run
        finished: not a rejection (review 33 of issue 15, m3); else ``cluster_gone``.
        Returns whether it was a member."""
        known = self.clusters.pop(cluster_id, None) is not None
        self._member_keys.pop(Identity.cluster(cluster_id).name, None)  # its key stops working
        rnd = self._state.current
        slot = rnd.slots.get(cluster_id) if rnd is not None else None
        in_update = (slot is not None and slot.ok and self._state.phase is Phase.UPDATE
                     and self._decided != rnd.number)
        if in_update:
            self._leaving.add(cluster_id)
        elif self.ledger is not None:
            self.ledger.release(cluster_id)
        gone = withdrawn or bool(self._state.finished)
        code = RejectCode.WITHDRAWN if gone else RejectCode.CLUSTER_GONE
        self._apply(MemberGone(self._clock(), cluster_id, reason, code))
        return known

    def lease(self, cluster_id: str, n: int) -> tuple[list[tuple[int, int]], int, int]:
        """Lease up to ``n`` more chunks to a member; returns (holdings, windows per chunk,
        epoch). A member gets no more than an honest one can hold
        (:func:`dips.algo.limits.lease_allowed`); once no chunk is free, it gets those of a
        member whose accepted position stood still for ``cfg.lease_timeout_s`` seconds
        (:meth:`dips.algo.ledger.ChunkLedger.idle_chunks`, review 14, F3), so a lease without
        progress starves no one of data nor keeps the epoch from ending. ``n`` = 0 returns the
        holdings unchanged: a member re-syncs with it.

        Raises Refused: NOT_JOINED, NO_LEDGER, INVALID_ARGUMENT (n < 0).
        """
        if n < 0:
            raise Refused(Refusal.INVALID_ARGUMENT, f"lease field 'n' = {n} must be >= 0")
        with self._cond:
            self._member(cluster_id)
            if self.ledger is None:
                raise Refused(Refusal.NO_LEDGER, "this run has no data-chunk ledger")
            n = lease_allowed(len(self.ledger.holdings(cluster_id)), n, self.cfg.lease_ahead,
                              self.cfg.max_push_tokens, self.tokens_per_window or 1,
                              self.ledger.windows_per_chunk)
            taken: dict[str, list[int]] = {}
            if n > 0:
                holders = [c.holder for c in self.ledger.chunks]
                for chunk, _ in self.ledger.lease(cluster_id, n, self._clock(),
                                                  self.cfg.lease_timeout_s):
                    if holders[chunk] is not None:
                        taken.setdefault(holders[chunk], []).append(chunk)
            answer = (self.ledger.holdings(cluster_id), self.ledger.windows_per_chunk,
                      self.ledger.epoch)
        for idle, chunks in sorted(taken.items()):
            self.event("chunks_reassigned", cluster=cluster_id, idle_holder=idle, chunks=chunks,
                       idle_after_s=self.cfg.lease_timeout_s)
        return answer

    def _member(self, cluster_id: str) -> ClusterEntry:
        if cluster_id not in self.clusters:
            raise Refused(Refusal.NOT_JOINED, f"cluster {cluster_id!r} has not joined")
        return self.clusters[cluster_id]

    def _monitor(self) -> None:
        """Remove silent clusters; mark silent followers down (§12: 3 missed heartbeats),
        counting silence only while the leader itself ran (:meth:`_watch`)."""
        period = min(0.25, self.cfg.membership.heartbeat_interval_s / 2)
        while not self._stop.wait(period):
            self._watch(period)

    def _watch(self, period_s: float) -> list[tuple[str, dict]]:
        """One tick of the monitor, meant every ``period_s`` seconds; returns the events it
        wrote. A member is silent for the time since its last heartbeat less the leader's own
        stalls (:func:`dips.algo.liveness.silent_s`: a late tick of this monitor, its lock or
        GIL held by something else, is the leader's fault, not the member's; review 21, F2),
        found by the tick's lateness on ``_tick_clock`` (the process's monotonic clock, which
        its thread is scheduled by; None on a leader whose clock a test moves by hand)."""
        members = self.cfg.membership
        limit = members.missed_heartbeats * members.heartbeat_interval_s
        events: list[tuple[str, dict]] = []
        with self._cond:
            now = self._clock()
            seen = [c.last_seen for c in self.clusters.values()]
            seen += [f.last_seen for f in self.followers.values() if f.up]
            tick = self._tick_clock() if self._tick_clock is not None else None
            self._lag, stalled = ticked(self._lag, tick, now, period_s, min(seen, default=now))
            if stalled > 0:
                self._stalls.warning("stall", "the leader did not run for %.2f s: members' "
                                     "silence in it is not counted against them", stalled)
            missing = sorted(set(range(self.cfg.followers)) - set(self.followers))
            if missing:  # nothing trains until they register
                self._waiting.info("missing", "waiting for follower(s) %s to register", missing)
            for c in list(self.clusters.values()):
                silent = silent_s(c.last_seen, now, self._lag)
                if silent > limit:
                    self._drop_cluster(c.cluster_id, "heartbeat timeout")
                    # After the finish, a cluster gone silent ended cleanly: not a fault.
                    after = {"after_finish": True} if self._state.finished else {}
                    events.append(("cluster_removed", {"cluster": c.cluster_id,
                                                       "silent_s": round(silent, 3), **after}))
            for f in self.followers.values():
                silent = silent_s(f.last_seen, now, self._lag)
                if f.up and silent > limit:
                    f.up = False
                    self.followers_epoch += 1
                    self.needs_reconcile = True
                    events.append(("follower_down", {"follower": f.index,
                                                     "silent_s": round(silent, 3)}))
            self._sync_ready(now)
        for kind, extra in events:
            self.event(kind, **extra)
        if events:
            self.checkpoint()  # removals returned chunks: durable before a restart
        return events
