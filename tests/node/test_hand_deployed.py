"""A run deployed by hand with the public commands (`dips leader`, `dips follower`,
`dips cluster`, `dips export`), here with `--insecure` on 127.0.0.1: it ends by itself at its
limit (the leader decides; found by a review: a hand-deployed run went on for ever), the
cluster exits 0, and the operator exports the final model. `--insecure` runs and says so on
stderr; with neither --tls nor --insecure a role refuses to start (exit 2, one line)."""

from __future__ import annotations

import json
import signal
import time

import pytest
import yaml
from typer.testing import CliRunner

from dips.cli import app
from dips.emu.launcher import free_port
from dips.wire.security import INSECURE_WARNING

from .roles import ROOT, follower_args, kill_left, stop_cleanly
from .roles import dips as _dips

pytestmark = pytest.mark.timeout(400)


def test_neither_tls_nor_insecure_refuses_to_start(tmp_path):
    neither = _dips(["leader", "--config", str(ROOT / "configs" / "tiny.yaml"), "--listen",
                     "127.0.0.1:1", "--state-dir", str(tmp_path / "x")])
    _, err = neither.communicate(timeout=60)
    assert neither.returncode == 2 and "exactly one of --tls DIR" in err


def test_a_member_says_why_the_leader_does_not_answer_and_stops_cleanly(tmp_path):
    """Found by a review: a --tls member facing an --insecure leader (or none) waited
    silently, and SIGTERM while it waited exited 2 with a misleading time-out."""
    log = tmp_path / "a.log"
    proc = _dips(["cluster", "--leader", f"127.0.0.1:{free_port()}", "--cluster-id", "a",
                  "--state-dir", str(tmp_path / "a"), "--insecure"], log)
    try:
        for _ in range(600):  # the event, not a duration: the first warning line
            if "no answer for" in log.read_text() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert "same --tls/--insecure choice" in log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_hand_deployed_run_ends_at_its_limit_and_the_model_is_exported(tmp_path):
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg.update(clusters=[{"id": "a"}], max_outer_steps=2, max_time_s=None)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    leader = f"127.0.0.1:{free_port()}"
    procs = {"leader": _dips(["leader", "--config", str(tmp_path / "run.yaml"), "--listen",
                              leader, "--state-dir", str(tmp_path / "leader"), "--insecure"],
                             tmp_path / "leader.log")}
    control = {}
    for i in (0, 1):
        args = follower_args(leader, i, tmp_path / f"f{i}")
        control[i] = args[args.index("--listen") + 1]
        procs[f"f{i}"] = _dips(args, tmp_path / f"f{i}.log")
    procs["a"] = _dips(["cluster", "--leader", leader, "--cluster-id", "a", "--state-dir",
                        str(tmp_path / "a"), "--insecure"], tmp_path / "a.log")
    try:
        assert procs["a"].wait(300) == 0, (tmp_path / "a.log").read_text()[-3000:]
        assert "the run finished (max outer steps)" in (tmp_path / "a.log").read_text()
        export = _dips(["export", "--leader", leader, "--out", str(tmp_path / "final"),
                        "--insecure"])
        out, err = export.communicate(timeout=200)
        assert export.returncode == 0, err[-3000:]
        doc = json.loads((tmp_path / "final" / "export.json").read_text())
        assert doc["finished"] == "max outer steps" and doc["version"] >= 2
        assert doc["eval_loss"] < doc["eval_loss_initial"]
        assert (tmp_path / "final" / "model.safetensors").exists()
        assert json.loads(out.strip().splitlines()[-1]) == doc
        # Review 15, #6: a follower's control port given as the leader's is named as such.
        wrong = CliRunner().invoke(app, ["status", "--leader", control[1], "--insecure"])
        assert wrong.exit_code == 2 and (f"{control[1]}: this is follower 1's control service "
                                         f"(its leader: {leader}), not the leader") in wrong.stderr
        stop_cleanly(procs, ("f0", "f1", "leader"))
    finally:
        kill_left(procs)
    log = (tmp_path / "leader.log").read_text()
    assert INSECURE_WARNING in log and "run finished (max outer steps)" in log
