"""Counts that survive restarts (issue 15): a cluster killed and restarted, a leader restarted,
a step rolled back. ``summary.json``'s per-cluster counts come from the leader's
``outer_steps.jsonl`` (one file over every leader process; a cluster keeps its id), not from
what a cluster's process says of itself; its tokens consumed sum every process it ran as; the
leader's Prometheus counters go on after a restart (replayed records, checkpointed ledger
counts) instead of starting again. All inputs are hand-built: no process, no timing."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from dips.algo.pushcounts import leader_counts
from dips.emu.summary import per_cluster, tokens_consumed
from dips.node.metrics import LeaderMetrics
from dips.spec import ClusterConfig, RunConfig


def decision(rnd: int, version: int, accepted: list[str], rejected: dict[str, str],
             tokens: dict[str, int]) -> dict:
    return {"round": rnd, "version": version, "clusters": sorted(tokens), "accepted": accepted,
            "rejected": {c: {"score": 1.0, "reason": r} for c, r in rejected.items()},
            "tokens": tokens, "time": 100.0 + rnd}


# Leader process 1: rounds 1-3; a's process is killed after round 2 and restarted (same id);
# leader process 2 (rounds above its reserved block, 65-): version 3 is rolled back, then
# rebuilt; round 66's line appears twice (a copy cut and appended again) and counts once.
OUTER_STEPS = [
    decision(1, 1, ["a", "b"], {}, {"a": 100, "b": 50}),
    {"event": "round_end", "round": 1},
    decision(2, 2, ["a"], {"b": "penalty"}, {"a": 100, "b": 40}),
    decision(3, 3, ["a", "b"], {}, {"a": 30, "b": 60}),   # a's restarted process
    {"event": "rollback", "version": 2, "lost": 1, "time": 110.0},
    decision(65, 2, [], {"a": "round failed: UNAVAILABLE"}, {"a": 30}),
    decision(66, 3, ["b"], {"a": "push not delivered in time"}, {"a": 30, "b": 60}),
    decision(66, 3, ["b"], {"a": "push not delivered in time"}, {"a": 30, "b": 60}),
]


def test_per_cluster_counts_come_from_the_leaders_record_over_every_process():
    got = leader_counts(OUTER_STEPS)
    assert got == {
        "a": {"updates_pushed": 5, "updates_accepted": 2, "updates_rejected": 2,
              "updates_lost": 1, "tokens_pushed": 290, "tokens_accepted": 200},
        "b": {"updates_pushed": 4, "updates_accepted": 2, "updates_rejected": 1,
              "updates_lost": 1, "tokens_pushed": 210, "tokens_accepted": 110}}
    # The leader's own totals (its counts in leader.json) are the sums.
    assert sum(r["updates_pushed"] for r in got.values()) == 9
    assert sum(r["tokens_accepted"] for r in got.values()) == 100 + 50 + 100 + 60


def write_train(run_dir: Path, cid: str, records: list[dict]) -> None:
    d = run_dir / "clusters" / cid
    d.mkdir(parents=True)
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_restarted_process_is_found_by_its_step_even_when_its_count_does_not_drop(tmp_path):
    cfg = RunConfig(clusters=[ClusterConfig(id="a"), ClusterConfig(id="b")])
    # a's first process died after one step; its second one logs the same count at step 1.
    write_train(tmp_path, "a", [{"event": "join"}, {"step": 1, "tokens": 256},
                                {"event": "join"}, {"step": 1, "tokens": 256},
                                {"step": 2, "tokens": 512}])
    write_train(tmp_path, "b", [{"step": 1, "tokens": 256}, {"step": 2, "tokens": 512}])
    assert tokens_consumed(tmp_path, cfg) == {"a": 256 + 512, "b": 512}
    (tmp_path / "outer_steps.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in OUTER_STEPS) + '{"round": 67, "vers')  # cut
    rows = per_cluster(tmp_path, cfg)
    assert rows["a"]["updates_lost"] == 1 and rows["b"]["tokens_accepted"] == 110
    # train.jsonl said 768 and 512; the leader saw a push 290 and b 210 tokens: never less
    assert (rows["a"]["tokens_consumed"], rows["b"]["tokens_consumed"]) == (768, 512)
    (tmp_path / "clusters" / "b" / "train.jsonl").write_text(
        json.dumps({"step": 1, "tokens": 128}) + "\n")  # killed before its lines were written
    assert per_cluster(tmp_path, cfg)["b"]["tokens_consumed"] == 210
    empty = per_cluster(tmp_path / "nothing", RunConfig(clusters=[ClusterConfig(id="c")]))
    assert empty == {"c": {"updates_pushed": 0, "updates_accepted": 0, "updates_rejected": 0,
                           "updates_lost": 0, "tokens_pushed": 0, "tokens_accepted": 0,
                           "tokens_consumed": 0}}


class Leader:
    """What the leader's collector reads; the ledger's counts as leader.json keeps them."""

    def __init__(self, counts: dict) -> None:
        self.counts = counts

    def status(self):
        return SimpleNamespace(version=3, rounds=66, phase="idle", finished="", clusters=[],
                               followers=[], followers_ready=0,
                               counts={"outer_steps": 3, "outer_steps_lost": 1, "restarts": 1})

    def ledger_summary(self):
        return {"epoch": 0, "accepted_windows": 9, "finished": 1, "held": 2, "free": 3,
                "counts": dict(self.counts)}


def test_the_leaders_counters_go_on_across_its_restart(tmp_path):
    lines = OUTER_STEPS[:-1]  # (the metrics fold each line: no repeated one here)
    (tmp_path / "outer_steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    ledger = {"leased": 12, "accepted": 3, "returned": 5}
    scrapes = []
    for _ in range(2):  # the process before and after a restart: same files, same leader.json
        reg = CollectorRegistry()
        metrics = LeaderMetrics(reg)
        metrics.replay(tmp_path)
        metrics.attach(Leader(ledger), clock=lambda: 0.0)
        scrapes.append({
            (m.name, tuple(sorted(m.labels.items()))): m.value
            for family in reg.collect() for m in family.samples})  # (no _created series)
    before, after = scrapes
    assert before == after
    get = lambda name, **labels: after[name, tuple(sorted(labels.items()))]  # noqa: E731
    assert get("dips_ledger_chunks_leased_total") == 12
    assert get("dips_ledger_chunks_accepted_total") == 3
    assert get("dips_ledger_chunks_returned_total") == 5
    # per cluster, every push decided (the counter keeps the rolled-back one: monotonic)
    assert get("dips_cluster_pushes_total", cluster="a", result="accepted") == 3
    assert get("dips_cluster_pushes_total", cluster="a", result="rejected") == 2
    assert get("dips_cluster_pushes_total", cluster="b", result="accepted") == 3
    assert get("dips_cluster_tokens_pushed_total", cluster="a") == 290
