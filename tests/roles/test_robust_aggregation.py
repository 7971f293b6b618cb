"""What a member just under the penalty's threshold can do to the model (issue 13; reviews of
2026-11-30 and 2026-12-01): §8's pooled statistics follow it, but every push enters the mean at
most ``outer.push_norm_ratio`` × √μ_robust and the clip's μ is capped at its square × μ_robust,
so once every member has pushed the outer step is at most twice an honest one, with one
colluder or two. The reviews of the bound's own gaps (``/tmp/review16``–``18``: a member that
pushes first and alone, in a run of two, or among clusters added later) are kept below.

The round runs through :func:`dips.roles.outer_step.run_update`, the code of the real leader
and of the virtual-time engine, with followers whose pseudo-gradients are orthogonal vectors of
the given norms (‖δ‖² = Σ_j w_j² ‖Δ_j‖²)."""

from __future__ import annotations

import json
import math

import pytest

from dips.algo.penalty import PenaltyState, robust_mu
from dips.algo.round import Slot
from dips.roles.outer_step import run_update
from dips.spec import OuterConfig, PenaltyConfig
from tests.roles.test_hostile_leader import FakeFollower, make_leader, member, wait_for

CFG, OUTER = PenaltyConfig(), OuterConfig()


class Vectors(FakeFollower):
    """A follower whose clusters pushed orthogonal Δ_j with ‖Δ_j‖² = ``norms[j]``."""

    def __init__(self) -> None:
        super().__init__()
        self.norms: dict[str, float] = {}

    def score(self, rnd, clusters, push_ids=None, retired=None):
        return [(c, True, self.norms[c], "") for c in clusters]

    def aggregate(self, rnd, clusters, weights):
        return sum(w * w * self.norms[c] for c, w in zip(clusters, weights))


def attack(hostile: list[str], honest: list[str], rounds: int, cfg: PenaltyConfig = CFG,
           outer: OuterConfig = OUTER) -> tuple[PenaltyState, list[dict]]:
    """Every round each hostile member pushes 90% of the largest ‖Δ‖² the penalty accepts
    (it knows μ, σ and the threshold); honest ones push ‖Δ‖² ≈ 1. Returns the history and
    each round's (step norm, hostile contribution norm) record."""
    follower, state, out = Vectors(), PenaltyState(), []
    for rnd in range(1, rounds + 1):
        for i, c in enumerate(honest):
            follower.norms[c] = 1.0 + 0.05 * math.sin(rnd + i)
        if state.n_seen >= cfg.warmup:
            mu, sigma = state.pooled(cfg)
            threshold = cfg.beta * max([cfg.score_floor, *(e for _, e in state.recent)])
            for c in hostile:
                follower.norms[c] = mu + 0.9 * threshold * sigma
        else:
            for c in hostile:
                follower.norms[c] = 1.0
        slots = [Slot(c, f"{rnd:08x}{i:08x}", rnd - 1, 100, 0.0, round=rnd, admitted_at=0.0,
                      done=True, ok=True) for i, c in enumerate(sorted(follower.norms))]
        report = run_update([(0, follower)], rnd, slots, rnd - 1, state, cfg, outer)
        assert not report.failed
        state = report.penalty
        accepted = report.outcome.accepted
        w = {c: report.weights[c] for c in accepted}
        scales = {c: report.push_scales.get(c, 1.0) for c in accepted}
        out.append({"step": report.outcome.clip_factor * math.sqrt(report.delta_sq_norm),
                    "hostile": math.sqrt(sum((w[c] * scales[c]) ** 2 * follower.norms[c]
                                             for c in accepted if c in hostile)),
                    "accepted": accepted})
    return state, out


@pytest.mark.parametrize("hostile,honest", [(["h"], ["a", "b"]), (["h1", "h2"], ["a", "b", "c"]),
                                            (["h"], ["a"])])
def test_a_member_under_the_threshold_makes_no_step_over_twice_an_honest_one(hostile, honest):
    state, rounds = attack(hostile, honest, 60)
    # §8's test accepts the attack (the limit of a norm test, RELIABILITY.md) ...
    assert all(set(hostile) <= set(r["accepted"]) for r in rounds[5:20])
    # ... but its pushes enter the statistics at most at the robust bound (review 30; without
    # it the pooled μ passed 1e6: the next test), the robust scale stays an honest cluster's,
    # and so does every step: at most the relative clip of an honest μ (0.4 · √(2² · 1.05)),
    # the hostile share at most its weight × 2 · √μ_robust.
    assert robust_mu(state) < 1.06
    assert state.mu <= OUTER.push_norm_ratio ** 2 * robust_mu(state)
    bound = OUTER.clip_ratio * OUTER.push_norm_ratio * math.sqrt(1.06)
    assert max(r["step"] for r in rounds) <= bound
    n = len(hostile) + len(honest)
    assert max(r["hostile"] for r in rounds) <= len(hostile) / n * 2 * math.sqrt(1.06) + 1e-9


def test_without_the_bound_the_same_member_takes_the_step():
    # The ablation push_norm_ratio = None is §8 with the relative clip: the step follows the
    # dragged μ (a real run's honest clusters diverged this way, review of 2026-11-30).
    state, rounds = attack(["h"], ["a", "b"], 30, outer=OuterConfig(push_norm_ratio=None))
    assert max(r["step"] for r in rounds) > 100 * OUTER.clip_ratio * OUTER.push_norm_ratio
    assert state.mu > 1e6  # §8's pooled statistics follow the attack


@pytest.mark.parametrize("members", [2, 3, 4, 5])
def test_a_member_that_pushes_first_and_alone_cannot_set_the_scale(members):
    """Review of 2026-12-01 (``/tmp/review16/a_startup.py``): a hostile member of three pushes
    G = 1e20 alone in the first rounds (the warm-up accepts it); the steps were 4e9. Until
    half of the run's members have pushed, the seed's clip norm c (``outer.max_norm``) is the
    scale (:func:`dips.algo.penalty.robust_mu`), so each step stays within
    clip_ratio × push_norm_ratio × c; once an honest member joins, the scale is its own."""
    follower, state = Vectors(), PenaltyState()
    follower.norms = {"h": 1e20}
    bound = OUTER.clip_ratio * OUTER.push_norm_ratio * OUTER.max_norm
    for rnd in range(1, 4):
        slot = Slot("h", f"{rnd:016x}", rnd - 1, 100, 0.0, round=rnd, admitted_at=0.0,
                    done=True, ok=True)
        report = run_update([(0, follower)], rnd, [slot], rnd - 1, state, CFG, OUTER,
                            members=members)
        state = report.penalty
        step = report.outcome.clip_factor * math.sqrt(report.delta_sq_norm)
        assert step <= bound * (1 + 1e-9)
    # Honest members now push ‖Δ‖² = 1 until half of the run has: the hostile history of
    # 1e20 is then outranked, and steps fall to the honest scale.
    honest = [f"a{i}" for i in range((members + 1) // 2)]
    for rnd in range(4, 8):
        follower.norms = {**{c: 1.0 for c in honest}, "h": 1e20}
        slots = [Slot(c, f"{rnd:08x}{i:08x}", rnd - 1, 100, 0.0, round=rnd, admitted_at=0.0,
                      done=True, ok=True) for i, c in enumerate(sorted(follower.norms))]
        report = run_update([(0, follower)], rnd, slots, rnd - 1, state, CFG, OUTER,
                            members=members)
        state = report.penalty
        step = report.outcome.clip_factor * math.sqrt(report.delta_sq_norm)
        assert step <= OUTER.clip_ratio * OUTER.push_norm_ratio * 1.0 * (1 + 1e-9)
    assert robust_mu(state, members) == pytest.approx(1.0)
    # Without the quorum (members unknown: those in the history) the first push set the scale.
    lone = Vectors()
    lone.norms = {"h": 1e20}
    alone = run_update([(0, lone)], 1, [Slot("h", "0" * 16, 0, 100, 0.0, round=1,
                                                  admitted_at=0.0, done=True, ok=True)],
                       0, PenaltyState(), CFG, OUTER)
    assert robust_mu(alone.penalty) > 1e19


@pytest.mark.parametrize("roster", [set(), {"c0", "x", "y"}, {"c0"}])
def test_the_leader_counts_the_clusters_issued_before_they_join(tmp_path, roster):
    """Review 18, A: a run configured with fewer clusters than were issued (the others added
    with ``dips init --add-cluster``) took the one added member that joined first as the whole
    run, and its push of ‖Δ‖² = 1e20 set the scale: a step of 5e9. The leader counts the
    clusters its ``clusters.txt`` lists (``Leader.roster``): with three issued, a lone first
    push is held to the seed's clip norm; so it is with a stale list that lacks the member
    (review 19, A′: the operator did not copy it after ``--add-cluster``), whose members
    joined count too."""
    leader, fake = make_leader(tmp_path, ledger=False)  # configured_clusters: 0
    norms = {"x": 1e20}
    fake.score = lambda rnd, clusters, push_ids=None, retired=None: [(c, True, norms[c], "") for c in clusters]
    fake.aggregate = lambda rnd, clusters, weights: sum(w * w * norms[c]
                                                        for c, w in zip(clusters, weights))
    leader.roster = lambda: roster
    try:
        member(leader, "x")
        grant = leader.request_push("x", 0, 1, 5.0)
        assert leader.push_done("x", grant.push_id, True, "", 30.0).verdict.accepted
        path = tmp_path / "outer_steps.jsonl"

        def record():
            lines = path.read_text().splitlines(keepends=True) if path.exists() else []
            done = [json.loads(line) for line in lines if line.endswith("\n")]
            return [r for r in done if r["round"] == grant.round]
        wait_for(record, "the round's record")
        rec = record()[0]
        step = rec["clip_factor"] * math.sqrt(rec["delta_sq_norm"])
        if roster:
            assert step <= OUTER.clip_ratio * OUTER.push_norm_ratio * OUTER.max_norm * (1 + 1e-9)
        else:  # what the review saw: the lone member is the run
            assert step > 1e9
    finally:
        leader.stop()
