"""The leader's side of the periodic evaluator (issue 15), in process: ``ReportEval`` over a
real gRPC server on 127.0.0.1 (insecure identities) takes reports from the operator's identity
only, refuses each malformed report by field and value without changing anything, appends
``eval.jsonl`` durably (also across a restart and a line cut by a crash), and shows the last
report in ``GetStatus``/``dips status`` and the ``dips_heldout_*`` metrics; ``dips report``
finds the file in a hand-deployed leader's state directory and in a launch run directory."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from dips.algo.evaluation import EvalReport
from dips.algo.refusal import Refusal, Refused
from dips.bench.runreport.files import load_run
from dips.bench.runreport.run_plots import heldout_points, plot_loss_vs_time, plot_loss_vs_tokens
from dips.cli import app
from dips.node.metrics import LeaderMetrics
from dips.roles.leader import Leader
from dips.wire import heldout
from dips.wire.control import refusal_of
from dips.wire.pb import control_pb2 as pb
from tests.roles.test_hostile_leader import Site, make_leader

pytestmark = pytest.mark.timeout(120)


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def one_step(site: Site, tokens: int = 64) -> None:
    """Cluster a's push alone makes the next version (the window closes on the test's clock)."""
    a = site.join("cluster-a")
    grant = a.RequestPush(pb.PushRequest(base_version=site.leader.version, tokens=tokens))
    site.clock.advance(5.0)
    assert a.PushDone(pb.PushDoneRequest(push_id=grant.push_id, ok=True)).accepted


@pytest.fixture
def site(tmp_path):
    s = Site(tmp_path)
    yield s
    s.close()


def test_the_operator_reports_and_the_leader_appends_one_line_per_version(site, tmp_path):
    seen: list = []
    site.leader.observer = lambda stream, rec: seen.append((stream, rec))
    admin = site.client("admin")
    rec0 = heldout.report_eval(admin, EvalReport(0, 6.25, 4032), 10)
    one_step(site, tokens=64)
    rec1 = heldout.report_eval(admin, EvalReport(1, 5.5, 4032), 10)
    assert (rec0["version"], rec0["tokens_accepted"]) == (0, 0)
    assert (rec1["version"], rec1["tokens_accepted"], rec1["eval_tokens"]) == (1, 64, 4032)
    assert rec1["perplexity"] == pytest.approx(math.exp(5.5))
    written = lines(tmp_path / "eval.jsonl")
    assert [{k: r[k] for k in ("version", "tokens_accepted", "eval_loss")} for r in written] == \
        [{"version": 0, "tokens_accepted": 0, "eval_loss": 6.25},
         {"version": 1, "tokens_accepted": 64, "eval_loss": 5.5}]
    assert set(written[1]) == {"time", "version", "tokens_accepted", "eval_loss", "perplexity",
                               "eval_tokens"}
    assert written[1]["time"] == rec1["time"] and rec1["time"] > 1e9  # epoch seconds
    assert [s for s, _ in seen if s == "eval"] == ["eval", "eval"]
    status = admin.GetStatus(pb.StatusRequest())
    assert heldout.last_eval(status) == written[1]


@pytest.mark.parametrize("name", ["cluster-a", "follower-0", "leader"])
def test_a_member_identity_cannot_report(site, tmp_path, name):
    client = site.client(name)
    with pytest.raises(grpc.RpcError) as info:
        heldout.report_eval(client, EvalReport(0, 6.0, 10), 10)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refusal_of(info.value) is Refusal.FORBIDDEN
    assert "only the operator's identity ('admin'" in info.value.details()
    assert name in info.value.details()
    assert not (tmp_path / "eval.jsonl").exists()


@pytest.mark.parametrize("report, says", [
    (pb.EvalReport(version=1, eval_loss=math.nan, eval_tokens=10), "'eval_loss' = nan"),
    (pb.EvalReport(version=1, eval_loss=-math.inf, eval_tokens=10), "'eval_loss' = -inf"),
    (pb.EvalReport(version=1, eval_loss=5.0, eval_tokens=0), "'eval_tokens' = 0"),
    (pb.EvalReport(version=-3, eval_loss=5.0, eval_tokens=10), "'version' = -3: a version the "
                                                               "leader never had"),
    (pb.EvalReport(version=2, eval_loss=5.0, eval_tokens=10), "'version' = 2: in the future"),
    (pb.EvalReport(version=1, eval_loss=5.0, eval_tokens=10), "'version' = 1: repeated"),
    (pb.EvalReport(version=0, eval_loss=5.0, eval_tokens=10), "'version' = 0: older"),
])
def test_a_malformed_report_is_refused_naming_field_and_value_and_changes_nothing(
        site, tmp_path, report, says):
    admin = site.client("admin")
    one_step(site)
    heldout.report_eval(admin, EvalReport(1, 5.0, 10), 10)
    before = (tmp_path / "eval.jsonl").read_bytes()
    with pytest.raises(grpc.RpcError) as info:
        admin.ReportEval(report)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refusal_of(info.value) is Refusal.INVALID_ARGUMENT and says in info.value.details()
    assert (tmp_path / "eval.jsonl").read_bytes() == before
    assert heldout.last_eval(admin.GetStatus(pb.StatusRequest()))["version"] == 1


def test_a_restarted_leader_keeps_the_series_and_drops_a_line_cut_by_a_crash(tmp_path):
    leader, _ = make_leader(tmp_path, ledger=False)
    try:
        rec = leader.report_eval(EvalReport(0, 6.0, 100))
    finally:
        leader.stop()
    with open(tmp_path / "eval.jsonl", "a") as f:
        f.write('{"time": 1.0, "version": 7, "eval_lo')  # a crash in the middle of a line
    again: Leader = make_leader(tmp_path, ledger=False)[0]
    try:
        assert again.last_eval() == rec
        assert (tmp_path / "eval.jsonl").read_text().endswith("\n")
        with pytest.raises(Refused, match="'version' = 0: repeated"):
            again.report_eval(EvalReport(0, 5.0, 100))
        again.version = 3  # (as if three outer steps were decided since)
        again.report_eval(EvalReport(1, 5.0, 100), now=1767000000.0)
    finally:
        again.stop()
    written = lines(tmp_path / "eval.jsonl")
    assert [r["version"] for r in written] == [0, 1]
    assert written[1]["tokens_accepted"] is None  # versions 2, 3 were never decided here
    assert written[1]["time"] == 1767000000.0


def test_the_leader_metrics_and_status_screen_show_the_last_report(tmp_path):
    metrics = LeaderMetrics(CollectorRegistry())
    rec = {"time": 1767000000.0, "version": 8, "tokens_accepted": 16384, "eval_loss": 5.5,
           "perplexity": math.exp(5.5), "eval_tokens": 4032}
    (tmp_path / "eval.jsonl").write_text(json.dumps({**rec, "version": 4, "eval_loss": 6.0})
                                         + "\n" + json.dumps(rec) + "\nnot json\n")
    assert metrics.replay(tmp_path) == 2
    value = metrics.registry.get_sample_value
    assert value("dips_heldout_loss") == 5.5 and value("dips_heldout_loss_version") == 8
    assert value("dips_heldout_perplexity") == pytest.approx(math.exp(5.5))
    metrics.observe("eval", {**rec, "version": 9, "eval_loss": 11719.0, "perplexity": None})
    assert value("dips_heldout_loss_version") == 9 and value("dips_heldout_perplexity") == math.inf


def test_the_held_out_metrics_are_absent_until_an_evaluation_is_reported(tmp_path):
    """Review 35 of issue 15, F6: with no evaluator the leader served dips_heldout_loss 0.0
    and dips_heldout_perplexity 0.0 (a perfect model; a perplexity that cannot be)."""
    metrics = LeaderMetrics(CollectorRegistry())
    assert metrics.replay(tmp_path) == 0  # no eval.jsonl
    names = {s.name for f in metrics.registry.collect() for s in f.samples}
    assert not {n for n in names if "heldout" in n}, names
    metrics.observe("eval", {"version": 2, "eval_loss": 4.0})
    value = metrics.registry.get_sample_value
    assert (value("dips_heldout_loss"), value("dips_heldout_loss_version")) == (4.0, 2)
    assert value("dips_heldout_perplexity") == pytest.approx(math.exp(4.0))


def test_the_readme_metrics_table_lists_the_held_out_metrics():
    from dips.node.metrics_members import EvaluatorMetrics

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    leader, evaluator = CollectorRegistry(), CollectorRegistry()
    LeaderMetrics(leader).observe("eval", {"version": 1, "eval_loss": 5.0})
    EvaluatorMetrics(evaluator)
    names = {f.name for f in evaluator.collect()} | {
        f.name for f in leader.collect() if "heldout" in f.name}
    assert len(names) == 6
    for name in names:
        assert f"| `{name}" in text or f"| `{name}_total`" in text, name


def test_dips_status_shows_the_held_out_loss(site):
    one_step(site)
    heldout.report_eval(site.client("admin"), EvalReport(1, 5.4321, 4032), 10)
    result = CliRunner().invoke(app, ["status", "--leader", f"127.0.0.1:{site.port}",
                                      "--insecure", "--json"])
    assert result.exit_code == 0, result.output
    h = json.loads(result.stdout)["heldout"]
    assert (h["version"], h["eval_loss"], h["tokens_accepted"], h["eval_tokens"]) == \
        (1, 5.4321, 64, 4032)
    screen = CliRunner().invoke(app, ["status", "--leader", f"127.0.0.1:{site.port}",
                                      "--insecure"])
    assert screen.exit_code == 0 and "held-out loss 5.4321 nats/token" in screen.stdout
    assert "at version 1" in screen.stdout


def test_dips_report_plots_the_series_of_a_hand_deployed_leader_and_a_launch_run(site, tmp_path):
    admin = site.client("admin")
    heldout.report_eval(admin, EvalReport(0, 6.5, 100), 10)
    for loss in (6.0, 5.5):
        one_step(site)
        heldout.report_eval(admin, EvalReport(site.leader.version, loss, 100), 10)
    hand = tmp_path / "copied" / "leader-host" / "state"  # a host's state directory, copied
    hand.mkdir(parents=True)
    shutil.copy(tmp_path / "eval.jsonl", hand)
    (tmp_path / "copied" / "evaluator").mkdir()  # the evaluator's own state: no second series
    (tmp_path / "copied" / "evaluator" / "evaluate.json").write_text('{"last": null}')
    launch = tmp_path / "launch"  # dips launch: the leader's state directory is the run dir
    launch.mkdir()
    shutil.copy(tmp_path / "eval.jsonl", launch)
    (launch / "summary.json").write_text(json.dumps(
        {"eval_loss_initial": 6.5, "eval_loss_final": 5.5, "tokens_accepted": 128,
         "train_time_s": 10.0, "final_version": 2}))
    for root in (tmp_path / "copied", launch):
        run = load_run(root)
        assert [r["version"] for r in run.evals] == [0, 1, 2], root
        pts = heldout_points(run)  # the summary's versions 0 and 2 are the series' own
        assert [(k, v) for _, k, v in pts] == [(0.0, 6.5), (64.0, 6.0), (128.0, 5.5)]
        assert all(t is not None for t, _, _ in pts)
        for plot in (plot_loss_vs_time(run), plot_loss_vs_tokens(run)):
            assert plot.figure is not None, (root, plot.note)
            labels = [lb for ax in plot.figure.axes for lb in ax.get_legend_handles_labels()[1]]
            assert [lb for lb in labels if not lb.startswith("training stopped")] == [
                "global model, held-out"], (root, labels)
