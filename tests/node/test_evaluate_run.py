"""The periodic evaluator in a short real run (issue 15): `dips leader`, 2 × `dips follower`,
`dips cluster` and `dips evaluate --every 2`, `--insecure` on 127.0.0.1 with configs/tiny.yaml
ending at 8 outer steps. Waited for by events, never by durations: the evaluator reports the
held-out loss of every second version and of the final one; the leader's eval.jsonl holds them
at increasing versions with a falling loss, its metrics show the last one, a cluster's identity
cannot report, the evaluator never became a member, and SIGTERM stops it with exit code 0."""

from __future__ import annotations

import json
import signal

import grpc
import pytest
import yaml

from dips.algo.evaluation import EvalReport, due
from dips.algo.refusal import Refusal
from dips.bench.runreport.files import load_run
from dips.emu.launcher import free_port
from dips.wire import heldout
from dips.wire.control import refusal_of
from dips.wire.pki import Identity
from dips.wire.security import Credentials
from dips.wire.services import leader_client

from .roles import ROOT, follower_args, kill_left, stop_cleanly
from .roles import dips as _dips
from .test_metrics_run import _port, scrape, scrape_until, total

pytestmark = pytest.mark.timeout(400)
STEPS = 8


def test_the_evaluator_reports_a_falling_held_out_loss_the_leader_keeps(tmp_path):
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg.update(clusters=[{"id": "a"}], max_outer_steps=STEPS, max_time_s=None)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    leader = f"127.0.0.1:{free_port()}"
    state = tmp_path / "leader"
    procs = {"leader": _dips(["leader", "--config", str(tmp_path / "run.yaml"), "--listen", leader,
                              "--state-dir", str(state), "--insecure", "--metrics-port", "0",
                              "--metrics-host", "127.0.0.1"], tmp_path / "leader.log")}
    try:
        for i in (0, 1):
            procs[f"f{i}"] = _dips(follower_args(leader, i, tmp_path / f"f{i}"),
                                   tmp_path / f"f{i}.log")
        procs["evaluate"] = _dips(["evaluate", "--leader", leader, "--every", "2", "--insecure",
                                   "--state-dir", str(tmp_path / "evaluator"), "--metrics-port",
                                   "0", "--metrics-host", "127.0.0.1"], tmp_path / "evaluate.log")
        procs["a"] = _dips(["cluster", "--leader", leader, "--cluster-id", "a", "--state-dir",
                            str(tmp_path / "a"), "--insecure"], tmp_path / "a.log")
        port = _port(tmp_path / "leader.log", procs["leader"])

        # The event: the run finished and the evaluator reported its final version.
        samples = scrape_until(
            "the held-out loss of the final version", procs["evaluate"], port,
            lambda s: total(s, "dips_run_finished") == 1
            and total(s, "dips_heldout_loss_version") == total(s, "dips_version"))
        assert total(samples, "dips_version") == STEPS
        records = [json.loads(line) for line in (state / "eval.jsonl").read_text().splitlines()]
        versions = [r["version"] for r in records]
        assert len(records) >= 2 and versions[-1] == STEPS, versions
        assert all(due(b, 2, a, finished=b == STEPS) for a, b in zip(versions, versions[1:]))
        initial = json.loads((state / "run.json").read_text())["eval_loss_initial"]
        if versions[0] == 0:  # one evaluation routine: version 0's loss is the prepared one
            assert records[0]["eval_loss"] == pytest.approx(initial, abs=1e-6)
        assert records[-1]["eval_loss"] < initial, records  # version 0: about ln(512) = 6.24
        assert total(samples, "dips_heldout_loss") == records[-1]["eval_loss"]
        tokens = [r["tokens_accepted"] for r in records]
        assert tokens == sorted(tokens) and tokens[-1] > 0, tokens
        assert procs["a"].wait(120) == 0, (tmp_path / "a.log").read_text()[-3000:]
        mine = scrape(_port(tmp_path / "evaluate.log", procs["evaluate"]))  # the evaluator's
        assert total(mine, "dips_evaluations_total", result="reported") == len(records)
        assert total(mine, "dips_evaluated_version") == STEPS
        assert total(mine, "dips_evaluation_seconds_count") == len(records)

        # A cluster's identity cannot report; nothing changes.
        before = (state / "eval.jsonl").read_bytes()
        client = leader_client(leader, Credentials.insecure(Identity.cluster("a")), timeout_s=10)
        try:
            with pytest.raises(grpc.RpcError) as info:
                heldout.report_eval(client, EvalReport(STEPS, 0.1, 10), 10)
        finally:
            client.close()
        assert refusal_of(info.value) is Refusal.FORBIDDEN
        assert "not 'cluster-a'" in info.value.details()
        assert (state / "eval.jsonl").read_bytes() == before

        # The evaluator pulled only: never a member, never a holder of data chunks.
        doc = json.loads((state / "leader.json").read_text())
        assert set(doc["clusters"]) <= {"a"}  # (a left at the end: written at its leave)
        assert {holder for holder, _, _ in doc["ledger"]["chunks"]} <= {"a", None}
        assert load_run(tmp_path).evals == records  # dips report finds the series once

        procs["evaluate"].send_signal(signal.SIGTERM)
        assert procs["evaluate"].wait(60) == 0, (tmp_path / "evaluate.log").read_text()[-3000:]
        stop_cleanly(procs, ("f0", "f1", "leader"))
    finally:
        kill_left(procs)
    log = (tmp_path / "evaluate.log").read_text()
    assert "stopped:" in log and "held-out loss" in log
    saved = json.loads((tmp_path / "evaluator" / "evaluate.json").read_text())
    assert saved["last"]["version"] == STEPS and saved["counts"]["reported"] == len(records)
