"""The leader's outer step, follower reconciliation and metadata checkpoint (§6, §8, §12).

Split from :mod:`dips.roles.leader` (which owns membership, rounds and locking); everything
here runs in the leader's loop thread without the lock held, calling followers over their
control service. Tensors never pass through the leader.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dips.algo import clip_factor, decide, token_weights
from dips.algo.reconcile import FollowerReport, reconcile_target
from dips.roles import failpoints

if TYPE_CHECKING:
    from dips.roles.leader import Leader, Round

log = logging.getLogger(__name__)


class RoundFailed(RuntimeError):
    """The round could not be applied on every follower; nothing was applied anywhere."""


def outer_step(leader: "Leader", rnd: "Round") -> dict[str, Any]:
    """Score, decide, aggregate, clip and apply one round (two-phase across followers).

    Returns the round's record for ``outer_steps.jsonl``. Raises RoundFailed (after aborting
    the prepared step everywhere) if any follower fails before every follower prepared.
    """
    pushes = rnd.pushes
    delivered = sorted(c for c, p in pushes.items() if p.done and p.ok)
    invalid: dict[str, str] = {c: (p.error or "push not delivered in time")
                               for c, p in pushes.items() if c not in delivered}
    followers = leader.follower_list()
    norms = {c: 0.0 for c in delivered}
    if delivered:
        for f in followers:
            for c, valid, sq, err in f.control.score(rnd.number, delivered):
                if not valid:
                    invalid.setdefault(c, f"follower {f.index}: {err}")
                norms[c] += sq
    scored = {c: g for c, g in norms.items() if c not in invalid}
    accepted: list[str] = []
    scores: dict[str, float | None] = {}
    threshold = None
    new_penalty = leader.penalty
    if scored:
        verdict, new_penalty = decide(leader.penalty, scored, leader.cfg.penalty)
        accepted, scores, threshold = verdict.accepted, dict(verdict.scores), verdict.threshold
    tokens = {c: pushes[c].tokens for c in accepted}
    weights: dict[str, float] = {}
    clip, sq_norm, checksums, failed = None, None, {}, []
    if accepted:
        weights = token_weights(tokens, accepted, uniform=leader.cfg.uniform_weights)
        w = [weights[c] for c in accepted]
        sq_norm = sum(f.control.aggregate(rnd.number, accepted, w) for f in followers)
        clip = clip_factor(sq_norm, leader.cfg.max_norm if leader.cfg.max_norm else float("inf"))
        new_version = leader.version + 1
        try:
            for f in followers:
                f.control.apply(rnd.number, clip, new_version, accepted, w)
        except Exception as exc:
            abort_everywhere(leader, rnd.number)
            raise RoundFailed(f"prepare failed: {exc}") from exc
        # Every follower prepared: the step is decided. Record it durably (ledger, counts,
        # version) before any commit, so a restarted leader never loses or repeats it.
        leader.penalty = new_penalty
        leader.decide(rnd, new_version, accepted)
        failpoints.hit("update")
        for f in followers:
            try:
                checksums[f.index] = f.control.commit(new_version)[1]
            except Exception as exc:
                failed.append(f.index)
                log.warning("commit of version %d on follower %d failed: %s", new_version,
                            f.index, exc)
        if failed:
            leader.commit_failed(failed)
    else:
        for f in followers:
            f.control.discard(rnd.number)
        leader.penalty = new_penalty
    return {"round": rnd.number, "version": leader.version, "clusters": sorted(pushes),
            "accepted": accepted,
            "rejected": {c: {"score": scores.get(c), "reason": invalid.get(c, "penalty")}
                         for c in sorted(pushes) if c not in accepted},
            "scores": scores, "threshold": threshold,
            "sq_norms": {c: norms.get(c) for c in sorted(pushes)},
            "tokens": {c: p.tokens for c, p in pushes.items()},
            "base_versions": {c: p.base_version for c, p in pushes.items()},
            "weights": weights, "delta_sq_norm": sq_norm, "clip_factor": clip,
            "checksums": {str(k): v for k, v in checksums.items()}, "commit_failed": failed,
            "invalid": invalid, "scored": sorted(scored)}


def abort_everywhere(leader: "Leader", rnd: int) -> None:
    """Drop a prepared step on every reachable follower (best effort; logged)."""
    for f in leader.follower_list():
        try:
            f.control.abort(rnd)
        except Exception as exc:
            log.warning("abort of round %d on follower %d failed: %s", rnd, f.index, exc)


def reconcile(leader: "Leader") -> tuple[int, int]:
    """Bring every follower to one common version; returns (target, outer steps lost).

    Asks each follower for its committed, prepared and checkpointed versions, picks the
    target with :func:`dips.algo.reconcile.reconcile_target` capped at the leader's last
    recorded decision, restores it everywhere, then drops every staged push and prepared
    step. Steps lost = decided version − target. Raises on any follower failure (the
    caller retries later).
    """
    followers = leader.follower_list()
    reports = []
    for f in followers:
        version, prepared, ckpts = f.control.report()
        reports.append(FollowerReport(f.index, version, prepared, tuple(ckpts)))
    decided = leader.version
    target = reconcile_target(reports, cap=decided)
    for f in followers:
        f.control.restore(target)
        f.control.abort(10 ** 12)
    return target, max(0, decided - target)


def save_state(path: Path, state: dict[str, Any]) -> None:
    """Write the leader's metadata checkpoint atomically (tmp file + fsync + rename)."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_state(path: Path) -> dict[str, Any] | None:
    """The leader's last checkpoint, or None if there is none. Raises ValueError if corrupt."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"leader checkpoint {path} is corrupt: {exc}") from None
