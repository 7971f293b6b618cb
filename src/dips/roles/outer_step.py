"""The update phase of one round across the followers: score, decide, aggregate, clip and a
two-phase apply (§6, §8, §12 of the seed).

:func:`run_update` is the one copy of this sequence. The real leader calls it with gRPC
clients of its followers (:class:`dips.wire.services.FollowerControlClient`); the
virtual-time engine (:mod:`dips.emu.virtual`) with the followers' shards in process. The
decisions themselves are the pure functions of :mod:`dips.algo` (``decide``,
``token_weights``, ``clip_factor``); this module only moves their inputs and outputs between
followers. Tensors never pass through here.

Two-phase apply: every follower prepares θ' aside (``apply``); only when all prepared is the
step decided (``on_decided``, where the leader records it durably), then every follower
commits. A failure before the decision aborts the prepared step everywhere: nothing was
applied anywhere. A commit that fails after the decision is reported (``commit_failed``) and
the leader reconciles that follower to the decided version.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import grpc

from dips.algo import (
    clip_factor,
    clip_threshold,
    decide,
    push_bound,
    robust_scale,
    staleness_scale,
    token_weights,
)
from dips.algo.penalty import PenaltyState, robust_mu
from dips.algo.refusal import Refused
from dips.algo.round import RejectCode, Slot, UpdateOutcome
from dips.roles import failpoints
from dips.wire.control import describe

log = logging.getLogger(__name__)

__all__ = ["FollowerControl", "UpdateReport", "abort_everywhere", "run_update"]


class FollowerControl(Protocol):
    """What the leader needs from a follower (gRPC in production, the shard itself in process)."""

    def score(self, rnd: int, clusters: list[str], push_ids: list[str] | None = None,
              retired: list[str] | None = None) -> list[tuple[str, bool, float, str]]: ...
    def aggregate(self, rnd: int, clusters: list[str], weights: list[float]) -> float: ...
    def apply(self, rnd: int, clip: float, new_version: int, accepted: list[str],
              weights: list[float]) -> tuple[int, str]: ...
    def commit(self, new_version: int) -> tuple[int, str]: ...
    def abort(self, rnd: int | None) -> None: ...
    def restore(self, version: int) -> tuple[int, str]: ...
    def discard(self, rnd: int) -> None: ...
    def report(self) -> tuple[int, int, list[int]]: ...


@dataclass
class UpdateReport:
    """Everything one update phase decided and measured (one line of ``outer_steps.jsonl``).

    ``outcome``: what the round machine needs (:class:`dips.algo.round.UpdateOutcome`).
    ``penalty``: the §8 history after this round (the caller keeps it unless ``failed``).
    ``sq_norms``: G_j = Σ_i ‖Δ^(i,j)‖² per delivered cluster; ``weights``: normalised token
    weights of the accepted set; ``push_scales``: cluster -> s_j < 1 for a push scaled down to
    the robust bound (:func:`dips.algo.robust_scale`; empty when none was); ``delta_sq_norm``: ‖δ‖² (units of θ²); ``checksums``:
    follower index -> XXH3 of its shard at the new version (reported when it prepared the
    step); ``commit_failed``: followers whose commit failed; ``failed``: the round failed
    before its decision (nothing applied).
    """

    outcome: UpdateOutcome
    penalty: PenaltyState
    clusters: list[str]
    tokens: dict[str, int]
    base_versions: dict[str, int]
    ahead: list[str] = field(default_factory=list)
    sq_norms: dict[str, float | None] = field(default_factory=dict)
    scored: list[str] = field(default_factory=list)
    weights: dict[str, float] = field(default_factory=dict)
    push_scales: dict[str, float] = field(default_factory=dict)
    delta_sq_norm: float | None = None
    checksums: dict[int, str] = field(default_factory=dict)
    commit_failed: list[int] = field(default_factory=list)
    failed: bool = False

    def record(self, number: int) -> dict[str, Any]:
        """The JSON-able line of ``outer_steps.jsonl`` for round ``number``."""
        out = self.outcome
        accepted = list(out.accepted)
        rec = {"round": number, "version": out.version, "clusters": self.clusters,
               "accepted": accepted,
               "rejected": {c: {"score": out.scores.get(c),
                                "reason": out.invalid.get(c, out.error or "penalty"),
                                "code": out.code_of(c)}
                            for c in self.clusters if c not in accepted},
               "scores": dict(out.scores), "thresholds": dict(out.thresholds),
               "sq_norms": self.sq_norms, "tokens": self.tokens,
               "base_versions": self.base_versions, "ahead": self.ahead,
               "weights": self.weights, "push_scales": self.push_scales,
               "delta_sq_norm": self.delta_sq_norm, "clip_factor": out.clip_factor,
               "checksums": {str(k): v for k, v in self.checksums.items()},
               "invalid": dict(out.invalid), "scored": self.scored}
        if out.error:
            rec["error"] = out.error
        return rec


def run_update(followers: Sequence[tuple[int, FollowerControl]], number: int,
               slots: Sequence[Slot], version: int, penalty: PenaltyState, penalty_cfg: Any,
               outer: Any, on_decided: Callable[[UpdateReport], None] | None = None,
               weight_cap: int | None = None, members: int = 0) -> UpdateReport:
    """Score, decide, aggregate, clip and apply round ``number`` on every follower.

    Args:
        followers: ``(index, control)`` of every follower, in index order.
        number: the round; slots: its admitted pushes (``ok``: delivered).
        version: the global version before the round.
        penalty / penalty_cfg: the §8 history and settings (:class:`dips.spec.PenaltyConfig`).
        outer: :class:`dips.spec.OuterConfig`: the clip (``clip``, ``max_norm``,
            ``clip_ratio``; :func:`dips.algo.clip_threshold`) and ``uniform_weights`` (1/n
            weights instead of T_j, an ablation).
        weight_cap: the most tokens one push weighs in the mean (``cap`` of
            :func:`dips.algo.token_weights`; None: T_j as it is).
        members: the run's clusters, for the robust scale's quorum
            (:func:`dips.algo.penalty.robust_mu`; 0: those in the history). Until half of
            them have pushed, ``outer.max_norm`` (the seed's clip norm c) is the scale, and
            nothing bounds what enters the §8 statistics; from then on no G enters them above
            :func:`dips.algo.push_bound` of the history before the round (issue 13, review 30).
        on_decided: called with the report (its ``outcome`` the decided step, ``penalty`` the
            new history, ``checksums`` those of the prepared shards) once every follower
            prepared the step and before any commit: the leader records it durably there.

    Returns the :class:`UpdateReport`; never raises for a follower's failure (the report
    says ``failed`` or lists ``commit_failed``).
    """
    clusters = sorted(s.cluster_id for s in slots)
    by_id = {s.cluster_id: s for s in slots}
    report = UpdateReport(UpdateOutcome(version), penalty, clusters,
                          {c: by_id[c].tokens for c in clusters},
                          {c: by_id[c].base_version for c in clusters},
                          [c for c in clusters if by_id[c].ahead])
    delivered = [c for c in clusters if by_id[c].ok]
    invalid = {c: (by_id[c].error or "push not delivered in time")
               for c in clusters if c not in delivered}
    codes = {c: by_id[c].code or RejectCode.NOT_DELIVERED.value for c in invalid}
    # Every push of the round is decided here: those not delivered are named too, so that no
    # follower stages their chunks sent later (review 25, M2).
    retired = [by_id[c].push_id for c in clusters if c not in delivered and by_id[c].push_id]
    try:
        norms = {c: 0.0 for c in delivered}
        if delivered:
            push_ids = [by_id[c].push_id for c in delivered]
            for index, control in followers:
                for c, valid, sq, err in control.score(number, delivered, push_ids, retired):
                    if c not in norms:
                        raise ValueError(f"follower {index}: Score of round {number} names "
                                         f"cluster {str(c)[:60]!r}, not in the round")
                    if not valid:
                        invalid.setdefault(c, f"follower {index}: {err}")
                        codes.setdefault(c, RejectCode.INVALID.value)
                    elif not _finite_square(sq):  # e.g. a push of finite values near 1e30
                        invalid.setdefault(c, f"follower {index}: ‖Δ‖² = {sq!r} is not a "
                                              "finite number >= 0")
                        codes.setdefault(c, RejectCode.INVALID.value)
                    norms[c] += sq if _finite_square(sq) else 0.0
        for c, g in norms.items():  # finite shards may still sum beyond the float range
            if not _finite_square(g):
                invalid.setdefault(c, f"‖Δ‖² = {g!r} over the shards is not finite")
                codes.setdefault(c, RejectCode.INVALID.value)
        scored = {c: g for c, g in norms.items() if c not in invalid}
        report.sq_norms = {c: norms.get(c) for c in clusters}
        report.scored = sorted(scored)
        accepted: list[str] = []
        scores: dict[str, float | None] = {}
        thresholds: dict[str, float] = {}
        new_penalty = penalty
        if scored:
            # Issue 13: no G enters the statistics larger than the history's robust bound
            # (none before half of the members have pushed: nothing to bound it by yet).
            bound = push_bound(robust_mu(penalty, members), outer.push_norm_ratio)
            verdict, new_penalty = decide(penalty, scored, penalty_cfg, bound)
            accepted, scores = list(verdict.accepted), dict(verdict.scores)
            thresholds = dict(verdict.thresholds)
        report.penalty = new_penalty
        if not accepted:
            report.outcome = UpdateOutcome(version, (), scores, thresholds, None, invalid,
                                           codes=codes)
            for index, control in followers:  # best effort: a reconcile drops leftovers anyway
                try:
                    if retired and not delivered:  # no Score named them
                        control.score(number, [], [], retired)
                    control.discard(number)
                except Exception as exc:
                    log.warning("discard of round %d on follower %d failed: %s", number, index, exc)
            return report
        weights = token_weights({c: by_id[c].tokens for c in accepted}, accepted,
                                uniform=outer.uniform_weights, cap=weight_cap)
        # Issue 13: no push enters the mean larger than the clusters' median scale allows, and
        # the clip's μ cannot be dragged up by a minority (dips.algo.aggregate.robust_scale).
        prior = None if outer.max_norm is None else outer.max_norm ** 2
        scales, clip_mu = robust_scale({c: scored[c] for c in accepted}, new_penalty.mu,
                                       robust_mu(new_penalty, members, prior),
                                       outer.push_norm_ratio)
        w = [weights[c] * scales[c] for c in accepted]
        report.push_scales = {c: s for c, s in scales.items() if s < 1.0}
        sq_norm = sum(control.aggregate(number, accepted, w) for _, control in followers)
        if not _finite_square(sq_norm):  # nothing applied: the round fails as a whole
            raise ValueError(f"round {number}: ‖δ‖² = {sq_norm!r} is not a finite number >= 0")
        clip_norm = clip_threshold(outer.clip, outer.max_norm, outer.clip_ratio, clip_mu)
        clip = clip_factor(sq_norm, clip_norm if clip_norm else float("inf"))
        clip *= staleness_scale(outer.staleness, weights,
                                {c: max(0, version - by_id[c].base_version) for c in accepted})
        report.weights, report.delta_sq_norm = weights, sq_norm
        new_version = version + 1
        for index, control in followers:
            report.checksums[index] = control.apply(number, clip, new_version, accepted, w)[1]
    except Exception as exc:  # nothing was applied anywhere
        if isinstance(exc, (grpc.RpcError, Refused, TimeoutError)):
            # A follower down, restarted or fenced: expected (§12), one line, no traceback.
            log.warning("round %d failed before its decision: %s", number, describe(exc))
        else:
            log.exception("round %d failed before its decision", number)
        abort_everywhere(followers, number)
        report.failed = True
        report.penalty = penalty
        report.outcome = UpdateOutcome(version, (), {}, {}, None, invalid,
                                       error=f"round failed: {describe(exc)}", codes=codes)
        return report
    # Every follower prepared: the step is decided. The caller records it durably before any
    # commit, so a restarted leader never loses or repeats it.
    report.outcome = UpdateOutcome(new_version, tuple(accepted), scores, thresholds, clip, invalid,
                                   codes=codes)
    if on_decided is not None:
        on_decided(report)
    failpoints.hit("update")
    for index, control in followers:
        try:
            control.commit(new_version)
        except Exception as exc:
            report.commit_failed.append(index)
            log.warning("commit of version %d on follower %d failed: %s", new_version, index, exc)
    return report


def _finite_square(x: Any) -> bool:
    """Whether a follower's squared norm is usable: a finite float >= 0."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def abort_everywhere(followers: Sequence[tuple[int, FollowerControl]], rnd: int | None) -> None:
    """Drop a prepared step (and what was staged up to round ``rnd``; None: every round) on
    every reachable follower (best effort; failures are logged)."""
    for index, control in followers:
        try:
            control.abort(rnd)
        except Exception as exc:
            log.warning("abort of round %s on follower %d failed: %s", rnd, index, describe(exc))
