"""What the launcher believes when it stops a run and sums it up (found by a fresh review).

A cluster's own reports (heartbeat token counts) must never stop a run: a heartbeat claiming
10^12 tokens once ended a 45 s run at 14 s. The leader now decides when a run ends (from its
ledger's count, :mod:`dips.algo.limits`); the launcher follows its verdict. And a restarted cluster's token counter starts
again at 0, so ``summary.json`` once reported fewer tokens consumed than accepted.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc

from dips.algo.refusal import Refusal
from dips.emu.launcher import stop_reason
from dips.emu.summary import tokens_consumed
from dips.spec import ClusterConfig, RunConfig
from dips.wire.control import describe
from dips.wire.pb import control_pb2 as pb


def _cfg(**kw) -> RunConfig:
    return RunConfig(clusters=[ClusterConfig(id="a"), ClusterConfig(id="b")], **kw)


def _status(tokens_accepted: int, claimed: int, outer_steps: int = 3) -> pb.StatusReply:
    return pb.StatusReply(tokens_accepted=tokens_accepted, outer_steps=outer_steps,
                          clusters=[pb.ClusterStatus(cluster_id="a", tokens=claimed),
                                    pb.ClusterStatus(cluster_id="b", tokens=claimed)])


def test_member_reports_never_stop_the_run_the_leaders_verdict_does():
    assert stop_reason(_status(10_000, claimed=10**12), 14.0, 45.0) is None
    finished = _status(20_000_000, claimed=0)
    finished.finished = "token budget"
    assert stop_reason(finished, 14.0, 45.0) == "token budget"
    assert stop_reason(None, 45.0, 45.0) == "max time"  # the leader silent: its own limit
    assert stop_reason(None, 44.9, None) is None


def test_tokens_consumed_sums_every_process_a_cluster_ran_as(tmp_path: Path):
    cfg = _cfg()
    lines = {"a": [{"event": "join"}, {"tokens": 256}, {"tokens": 512},    # first process
                   {"event": "join"}, {"tokens": 256}, {"tokens": 768}],  # restarted
             "b": [{"tokens": 256}, {"tokens": 512}]}
    for cid, recs in lines.items():
        d = tmp_path / "clusters" / cid
        d.mkdir(parents=True)
        (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert tokens_consumed(tmp_path, cfg) == {"a": 512 + 768, "b": 512}


def test_a_process_that_resumed_its_inner_state_counts_only_what_it_trained(tmp_path: Path):
    """Review 15: a cluster killed at step 4 (1,024 tokens) resumed the state saved at step 2
    (512 tokens) and counts on from there: its steps 3-5 are 768 new tokens, not 1,280."""
    cfg = _cfg()
    lines = {"a": [{"event": "join"}, {"step": 1, "tokens": 256}, {"step": 2, "tokens": 512},
                   {"step": 3, "tokens": 768}, {"step": 4, "tokens": 1024},      # killed here
                   {"event": "join"}, {"event": "resume", "steps": 2, "tokens": 512},
                   {"step": 3, "tokens": 768}, {"step": 4, "tokens": 1024},
                   {"step": 5, "tokens": 1280},                                  # killed again
                   {"event": "join"}, {"step": 1, "tokens": 256}],               # fresh start
             "b": [{"event": "join"}, {"event": "resume", "steps": 8, "tokens": 2048},
                   {"step": 9, "tokens": 2304}]}
    for cid, recs in lines.items():
        d = tmp_path / "clusters" / cid
        d.mkdir(parents=True)
        (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert tokens_consumed(tmp_path, cfg) == {"a": 1024 + 768 + 256, "b": 256}


def test_describe_names_the_code_not_the_debug_string():
    class Err(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.FAILED_PRECONDITION

        def details(self):
            return "cluster 'c' has not joined"

        def trailing_metadata(self):
            return (("dips-refusal", str(int(Refusal.NOT_JOINED))),)

    assert describe(Err()) == "FAILED_PRECONDITION (NOT_JOINED): cluster 'c' has not joined"
    assert describe(ValueError("bad")) == "ValueError: bad"


def test_a_cluster_killed_in_a_sync_counts_the_step_it_trained_before_it(tmp_path: Path):
    """Review 33 of issue 15, m5: cluster a killed in the pull of step 64 (16,384 tokens) left
    63 step lines; summary.json said 16,128. The ``sync_start`` record before the sync counts
    the step; the step's own line after a completed sync counts nothing more."""
    from dips.algo.consumed import consumed_series

    cfg = _cfg()
    step = [{"step": k, "tokens": 256 * k} for k in range(1, 65)]
    lines = {"a": [{"event": "join"}, *step[:63],
                   {"event": "sync_start", "inner_step": 64, "tokens": 16_384},  # killed here
                   {"event": "join"}, {"step": 1, "tokens": 256}],                # fresh start
             "b": [{"event": "join"}, *step[:7],
                   {"event": "sync_start", "inner_step": 8, "tokens": 2048},
                   {**step[7], "push": {"accepted": True}}, step[8]]}
    for cid, recs in lines.items():
        d = tmp_path / "clusters" / cid
        d.mkdir(parents=True)
        (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert tokens_consumed(tmp_path, cfg) == {"a": 16_384 + 256, "b": 9 * 256}
    series = consumed_series(lines["b"])  # the loss plots' points: one per step line
    assert [s.tokens for s in series] == [256 * k for k in range(1, 10)]
    assert {s.process for s in series} == {0}
