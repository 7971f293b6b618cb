"""A short real run of the role commands (`dips leader`, 2 × `dips follower`, `dips cluster`,
`--insecure` on 127.0.0.1), each with `--metrics-port 0`: every endpoint is scraped over HTTP
and parsed with prometheus_client's parser; at the end the leader's counters equal the counts
of its outer_steps.jsonl, leader_events.jsonl and leader.json, and after a restart of the
leader they go on from there instead of starting at 0. The leader logs JSON lines."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from dips.cli import app
from dips.emu.launcher import free_port

from .roles import ROOT, follower_args, kill_left, stop_cleanly
from .roles import dips as _dips

pytestmark = pytest.mark.timeout(400)
METRICS_LINE = re.compile(r"metrics on http://127\.0\.0\.1:(\d+)/metrics")


def _wait(what: str, proc: subprocess.Popen, check: Callable[[], object],
          deadline_s: float = 240.0) -> object:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` if ``proc``
    exits first or the deadline passes (a safety limit, not the awaited event)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and proc.poll() is None:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"{what}: not seen (exit code {proc.poll()})")


def _port(log: Path, proc: subprocess.Popen) -> int:
    def found() -> int | None:
        m = METRICS_LINE.search(log.read_text())
        return int(m.group(1)) if m else None
    return int(_wait(f"the metrics line in {log.name}", proc, found))


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape_until(what: str, proc: subprocess.Popen, port: int,
                 ready: Callable[[dict], bool]) -> dict:
    """The first scrape of ``port`` for which ``ready`` holds (see :func:`_wait`)."""
    def check() -> dict | None:
        samples = scrape(port)
        return samples if ready(samples) else None
    return _wait(what, proc, check)


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items()
               if n == name and set(labels.items()) <= set(ls))


def _records(path: Path) -> list[dict]:
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line]


def expected_from_files(state: Path) -> dict[str, float]:
    """The leader's counts as its own files tell them."""
    decisions = [r for r in _records(state / "outer_steps.jsonl") if "event" not in r]
    doc = json.loads((state / "leader.json").read_text())
    return {"steps": sum(bool(r["accepted"]) for r in decisions),
            "accepted": sum(len(r["accepted"]) for r in decisions),
            "rejected": sum(len(r["rejected"]) for r in decisions),
            "rounds": len(decisions),
            "ended": sum(r.get("event") == "round_end"
                         for r in _records(state / "outer_steps.jsonl")),
            "joined": sum(r["event"] == "cluster_joined"
                          for r in _records(state / "leader_events.jsonl")),
            "json_steps": doc["counts"]["outer_steps"],
            "json_accepted": doc["counts"]["updates_accepted"],
            "json_rejected": doc["counts"]["updates_rejected"], "version": doc["version"]}


def observed(samples: dict) -> dict[str, float]:
    return {"steps": total(samples, "dips_outer_steps_total"),
            "accepted": total(samples, "dips_pushes_total", result="accepted"),
            "rejected": total(samples, "dips_pushes_total", result="rejected"),
            "rounds": total(samples, "dips_rounds_total"),
            "joined": total(samples, "dips_leader_events_total", event="cluster_joined"),
            "version": total(samples, "dips_version")}


def agree(state: Path, port: int) -> tuple[dict, dict] | None:
    """(files, metrics) once the leader is at rest (idle, every round ended) and they agree."""
    files, samples = expected_from_files(state), scrape(port)
    seen = observed(samples)
    at_rest = (total(samples, "dips_phase", phase="idle") == 1 and files["rounds"] == files["ended"]
               and files["steps"] == files["json_steps"])
    same = all(seen[k] == files[k] for k in seen)
    return (files, seen) if at_rest and same else None


def test_every_role_serves_metrics_that_match_the_leader_records(tmp_path):
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg.update(clusters=[{"id": "a"}], max_outer_steps=None, max_time_s=None)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    leader = f"127.0.0.1:{free_port()}"
    metrics = ["--metrics-port", "0", "--metrics-host", "127.0.0.1"]
    state = tmp_path / "leader"
    leader_args = ["leader", "--config", str(tmp_path / "run.yaml"), "--listen", leader,
                   "--state-dir", str(state), "--insecure", "--log-format", "json", *metrics]
    procs = {"leader": _dips(leader_args, tmp_path / "leader.log")}
    try:
        for i in (0, 1):
            procs[f"f{i}"] = _dips(follower_args(leader, i, tmp_path / f"f{i}", *metrics),
                                   tmp_path / f"f{i}.log")
        procs["a"] = _dips(["cluster", "--leader", leader, "--cluster-id", "a", "--state-dir",
                            str(tmp_path / "a"), "--insecure", *metrics], tmp_path / "a.log")
        ports = {name: _port(tmp_path / f"{name}.log", p) for name, p in procs.items()}

        # The cluster: two accepted syncs, then its training and transfer metrics.
        cluster = scrape_until("two accepted syncs", procs["a"], ports["a"],
                               lambda s: total(s, "dips_syncs_total", result="accepted") >= 2)
        assert total(cluster, "dips_inner_steps_total") >= 2 * cfg["inner"]["H"]
        assert total(cluster, "dips_tokens_trained_total") > 0
        assert total(cluster, "dips_push_seconds_count") >= 2
        assert total(cluster, "dips_pull_seconds_count") >= 2
        assert 0 < total(cluster, "dips_train_loss") < 20 and total(cluster, "dips_version") >= 1
        trained = [r for r in _records(tmp_path / "a" / "train.jsonl") if "step" in r]
        assert total(cluster, "dips_inner_steps_total") <= len(trained)

        # The followers: data-plane bytes both ways, timed update calls, checkpoints.
        for name in ("f0", "f1"):
            f = scrape_until(f"{name}'s checkpoint of an outer step", procs[name], ports[name],
                             lambda s: total(s, "dips_checkpoint_version") >= 1)
            assert total(f, "dips_bytes_received_total") > 0 and total(f, "dips_bytes_sent_total") > 0
            assert total(f, "dips_follower_call_seconds_count", call="apply") >= 1
            assert total(f, "dips_follower_call_seconds_count", call="commit") >= 1
            assert total(f, "dips_checkpoint_seconds_count") >= 1
            assert total(f, "dips_version") >= 1

        procs["a"].send_signal(signal.SIGTERM)
        assert procs["a"].wait(120) == 0, (tmp_path / "a.log").read_text()[-3000:]

        # The leader at rest: its counters are the counts of its records and leader.json.
        files, seen = _wait("the leader's metrics to equal its records", procs["leader"],
                            lambda: agree(state, ports["leader"]))
        assert files["steps"] >= 2 and seen["accepted"] == files["json_accepted"]
        assert seen["rejected"] == files["json_rejected"] and seen["joined"] >= 1
        before = scrape(ports["leader"])
        assert total(before, "dips_members", role="follower") == 2
        assert total(before, "dips_phase_seconds_count", phase="update") == files["rounds"]

        # A restarted leader goes on from its persisted counts and records.
        procs["leader"].send_signal(signal.SIGTERM)
        assert procs["leader"].wait(60) == 0
        procs["leader"] = _dips(leader_args, tmp_path / "leader2.log")
        port = _port(tmp_path / "leader2.log", procs["leader"])
        after = scrape(port)
        assert observed(after) == observed(before)
        assert total(after, "dips_leader_restarts_total") == 1
        assert total(after, "dips_leader_events_total", event="leader_resumed") == 1
        # Per cluster and the ledger's chunks too (replayed records; leader.json's ledger).
        for name, labels in (("dips_cluster_pushes_total", {"cluster": "a"}),
                             ("dips_cluster_tokens_pushed_total", {"cluster": "a"}),
                             ("dips_ledger_chunks_leased_total", {}),
                             ("dips_ledger_chunks_returned_total", {})):
            assert total(after, name, **labels) == total(before, name, **labels), name
        assert total(after, "dips_cluster_pushes_total", cluster="a") == \
            files["accepted"] + files["rejected"]
        assert total(after, "dips_ledger_chunks_leased_total") >= 1
        assert total(after, "dips_ledger_chunks_returned_total") >= 1  # a left: its chunks back
        # dips status --json: the leader's faults of the last hour (its restart) and ages.
        shown = CliRunner().invoke(app, ["status", "--leader", leader, "--insecure", "--json"])
        assert shown.exit_code == 0, shown.output
        doc = json.loads(shown.stdout)
        assert doc["fault_window_s"] == 3600 and "leader_restarted" in {
            f["kind"] for f in doc["faults"]}
        # Every follower of the run is listed; one not registered again yet has no age.
        assert doc["followers_total"] == len(doc["followers"]) == 2
        assert all(f["heartbeat_age_s"] is not None for f in doc["followers"] if f["registered"])
        stop_cleanly(procs, ("f0", "f1", "leader"))
    finally:
        kill_left(procs)
    lines = [line for line in (tmp_path / "leader.log").read_text().splitlines()
             if line.startswith("{")]
    docs = [json.loads(line) for line in lines]
    assert any("serving on" in d["message"] and d["logger"] == "dips.node.leader" for d in docs)
    assert all({"time", "level", "logger", "message"} <= set(d) for d in docs)
