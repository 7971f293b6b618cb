"""The metrics of the role processes (dips.node.metrics, dips.node.metrics_members) fed with
hand-made records, the state collectors with stand-ins, the HTTP endpoint, and
``--log-format json``."""

from __future__ import annotations

import json
import logging
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from dips.node.common import JsonFormatter, RoleError
from dips.node.metrics import LeaderMetrics, MetricsServer, reason_class, serve_metrics
from dips.node.metrics_members import ClusterMetrics, FollowerMetrics
from dips.wire.refusals import Refusals
from dips.wire.workers import BusyTime

DECISION = {"round": 4, "version": 3, "clusters": ["a", "b", "c"], "accepted": ["a", "b"],
            "rejected": {"c": {"score": 9.5, "reason": "penalty", "code": "penalty"}},
            "scores": {"a": 0.1, "b": -0.4, "c": 9.5},
            "thresholds": {"a": 3.0, "b": 3.0, "c": 2.5},
            "sq_norms": {"a": 1.5, "b": 2.0, "c": 40.0}, "tokens": {"a": 2048, "b": 1024, "c": 512},
            "base_versions": {"a": 2, "b": 0, "c": 2}, "ahead": [],
            "weights": {"a": 0.667, "b": 0.333}, "delta_sq_norm": 0.8, "clip_factor": 0.5,
            "checksums": {"0": "x"}, "invalid": {}, "scored": ["a", "b", "c"],
            "window_s": 0.5, "push_s": 0.2, "update_s": 0.1, "time": 1.0}
FAILED = {"round": 5, "version": 3, "clusters": ["a", "d"], "accepted": [],
          "rejected": {"a": {"score": None, "reason": "round failed: UNAVAILABLE",
                             "code": "round_failed"},
                       "d": {"score": None, "reason": "push not delivered in time",
                             "code": "not_delivered"}},
          "scores": {}, "thresholds": {}, "sq_norms": {"a": None, "d": None},
          "tokens": {"a": 64, "d": 64}, "base_versions": {"a": 3, "d": 1},
          "error": "round failed: UNAVAILABLE"}
ROUND_END = {"event": "round_end", "round": 4, "version": 3, "commit_failed": [],
             "window_s": 0.5, "push_s": 0.2, "update_s": 0.1, "pull_s": 0.0,
             "grace": {"mode": "dynamic", "window_s": 0.4, "rate_per_s": 2.0,
                       "miss_cost_s": 1.5, "tau_star_s": 0.4}, "time": 2.0}


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_reason_classes_are_bounded_and_come_from_the_code():
    for code in ("penalty", "not_delivered", "invalid", "followers_not_ready", "cluster_gone",
                 "round_failed"):
        assert reason_class({"reason": "follower 1: whatever", "code": code}) == code
    assert reason_class({"reason": "push not delivered in time"}) == "other"  # no code
    assert reason_class({"code": "something new"}) == "other"


def test_leader_observer_folds_decisions_round_ends_and_events():
    reg = CollectorRegistry()
    m = LeaderMetrics(reg)
    for stream, rec in (("outer_steps", DECISION), ("outer_steps", ROUND_END),
                        ("outer_steps", FAILED), ("leader_events", {"event": "cluster_joined"}),
                        ("leader_events", {"event": "cluster_joined"}),
                        ("outer_steps", {"event": "rollback", "version": 2, "lost": 1})):
        m.observe(stream, rec)
    assert value(reg, "dips_rounds_total", outcome="stepped") == 1
    assert value(reg, "dips_rounds_total", outcome="failed") == 1
    assert value(reg, "dips_pushes_total", result="accepted", reason="none") == 2
    assert value(reg, "dips_pushes_total", result="rejected", reason="penalty") == 1
    assert value(reg, "dips_pushes_total", result="rejected", reason="round_failed") == 1
    assert value(reg, "dips_pushes_total", result="rejected", reason="not_delivered") == 1
    # staleness: the version before round 4 was 2 (it made version 3); round 5 left 3
    assert value(reg, "dips_cluster_staleness", cluster="b") == 2
    assert value(reg, "dips_cluster_staleness", cluster="a") == 0
    assert value(reg, "dips_cluster_staleness", cluster="d") == 2
    assert value(reg, "dips_penalty_score", cluster="c") == 9.5
    assert value(reg, "dips_penalty_threshold", cluster="c") == 2.5
    assert value(reg, "dips_sq_norm", cluster="c") == 40.0  # a later None leaves the last value
    assert value(reg, "dips_token_weight", cluster="a") == pytest.approx(0.667)
    assert value(reg, "dips_push_tokens", cluster="d") == 64
    assert value(reg, "dips_clip_factor") == 0.5 and value(reg, "dips_delta_sq_norm") == 0.8
    assert value(reg, "dips_phase_seconds_count", phase="window") == 1
    assert value(reg, "dips_phase_seconds_sum", phase="push") == pytest.approx(0.2)
    assert value(reg, "dips_grace_tau_star_seconds") == 0.4
    assert value(reg, "dips_grace_request_rate_per_second") == 2.0
    assert value(reg, "dips_grace_miss_cost_seconds") == 1.5
    assert value(reg, "dips_leader_events_total", event="cluster_joined") == 2


def test_an_older_line_with_one_threshold_sets_it_for_every_scored_cluster():
    reg = CollectorRegistry()
    old = {k: v for k, v in DECISION.items() if k != "thresholds"}
    LeaderMetrics(reg).observe("outer_steps", {**old, "threshold": 4.0})
    assert value(reg, "dips_penalty_threshold", cluster="b") == 4.0


def test_replay_restores_counters_from_the_previous_process_files(tmp_path):
    lines = [DECISION, ROUND_END, FAILED]
    (tmp_path / "outer_steps.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in lines) + '{"round": 6, "vers')  # cut by a crash
    (tmp_path / "leader_events.jsonl").write_text('{"event": "leader_resumed"}\n[1]\n')
    reg = CollectorRegistry()
    assert LeaderMetrics(reg).replay(tmp_path) == 4
    assert value(reg, "dips_pushes_total", result="accepted", reason="none") == 2
    assert value(reg, "dips_rounds_total", outcome="failed") == 1
    assert value(reg, "dips_leader_events_total", event="leader_resumed") == 1
    assert LeaderMetrics(CollectorRegistry()).replay(tmp_path / "empty") == 0


class FakeLeader:
    """What the leader's collector reads: status() and ledger_summary()."""

    def __init__(self, ledger: dict | None) -> None:
        self.ledger = ledger

    def status(self):
        counts = {"outer_steps": 7, "outer_steps_lost": 2, "tokens_pushed": 900,
                  "tokens_accepted": 700, "restarts": 3}
        return SimpleNamespace(
            version=7, rounds=11, phase="push", counts=counts, finished="",
            clusters=[SimpleNamespace(cluster_id="a", last_seen=95.0, inner_step=230,
                                      tokens_accepted=512),
                      SimpleNamespace(cluster_id="b", last_seen=130.0, inner_step=0,
                                      tokens_accepted=0)],  # after a restart
            followers=[SimpleNamespace(index=0, last_seen=99.5)], followers_ready=1)

    def ledger_summary(self):
        return self.ledger


def test_leader_state_at_scrape_time():
    reg = CollectorRegistry()
    LeaderMetrics(reg).attach(FakeLeader({"epoch": 1, "accepted_windows": 50, "finished": 2,
                                          "held": 3, "free": 4}), clock=lambda: 100.0)
    assert value(reg, "dips_outer_steps_total") == 9  # applied now + rolled back: monotonic
    assert value(reg, "dips_outer_steps_lost_total") == 2
    assert value(reg, "dips_leader_restarts_total") == 3
    assert value(reg, "dips_tokens_pushed_total") == 900 and value(reg, "dips_tokens_accepted") == 700
    assert value(reg, "dips_version") == 7 and value(reg, "dips_round") == 11
    assert value(reg, "dips_phase", phase="push") == 1 and value(reg, "dips_phase", phase="idle") == 0
    assert value(reg, "dips_members", role="cluster") == 2
    assert value(reg, "dips_heartbeat_age_seconds", role="cluster", member="cluster-a") == 5.0
    assert value(reg, "dips_heartbeat_age_seconds", role="cluster", member="cluster-b") == 0.0
    assert value(reg, "dips_heartbeat_age_seconds", role="follower", member="follower-0") == 0.5
    assert value(reg, "dips_cluster_inner_step", cluster="a") == 230
    assert value(reg, "dips_cluster_tokens_accepted", cluster="a") == 512
    assert value(reg, "dips_ledger_chunks", state="held") == 3
    assert value(reg, "dips_ledger_accepted_windows") == 50 and value(reg, "dips_ledger_epoch") == 1
    bare = CollectorRegistry()
    LeaderMetrics(bare).attach(FakeLeader(None), clock=lambda: 100.0)
    assert value(bare, "dips_ledger_epoch") is None and value(bare, "dips_version") == 7


def test_cluster_observer_folds_train_log_records():
    reg = CollectorRegistry()
    m = ClusterMetrics(reg)
    m.observe({"event": "join", "version": 0, "stages": [["0"]], "time": 10.0})
    for step in range(1, 5):
        rec = {"step": step, "loss": 6.0 - step, "tokens": 256 * step, "compute_s": 0.1,
               "time": 10.0 + step}
        if step == 2:
            rec["push"] = {"accepted": True, "ok": True, "version": 1, "round": 1, "tokens": 512,
                           "score": 0.3, "reason": "", "push_s": 0.2, "wait_s": 0.5, "pull_s": 0.1}
        if step == 4:
            rec["push"] = {"accepted": False, "ok": False, "version": 1, "round": -1,
                           "tokens": 512, "score": None, "reason": "link down", "push_s": 0.0,
                           "wait_s": 0.0, "pull_s": 0.0}
        m.observe(rec)
    assert value(reg, "dips_inner_steps_total") == 4
    assert value(reg, "dips_tokens_trained_total") == 1024
    assert value(reg, "dips_tokens_per_second") == pytest.approx(256.0)
    assert value(reg, "dips_train_loss") == 2.0
    assert value(reg, "dips_inner_step_seconds_count") == 4
    assert value(reg, "dips_syncs_total", result="accepted") == 1
    assert value(reg, "dips_syncs_total", result="failed") == 1
    assert value(reg, "dips_push_seconds_count") == 1  # the failed sync's times are not observed
    assert value(reg, "dips_verdict_wait_seconds_sum") == pytest.approx(0.5)
    assert value(reg, "dips_pull_seconds_sum") == pytest.approx(0.1)
    assert value(reg, "dips_push_score") == 0.3
    assert value(reg, "dips_cluster_events_total", event="join") == 1
    client = SimpleNamespace(version=3, leader_version=-1)
    m.attach(client)
    assert value(reg, "dips_version") == 3 and value(reg, "dips_base_version_lag") is None
    client.leader_version = 5
    assert value(reg, "dips_base_version_lag") == 2


class FakeShard:
    version = 4
    prepared_version = -1

    def __init__(self) -> None:
        self.calls: list[str] = []

    def state(self):
        return 0, self.version, "c"

    def score(self, rnd, clusters, push_ids=None, retired=None):
        self.calls.append("score")
        return [(c, True, 1.0, "") for c in clusters]

    def commit(self, version):
        raise ValueError("nothing prepared")


def test_a_clusters_hold_is_a_gauge_and_its_seconds_a_counter():
    """Review 15, #2: a cluster that cannot sync holds its training (dips.algo.hold)."""
    reg = CollectorRegistry()
    m = ClusterMetrics(reg)
    m.observe({"event": "hold", "reason": "sync overdue", "steps_since_sync": 8, "time": 1.0})
    assert value(reg, "dips_holding") == 1 and value(reg, "dips_hold_seconds_total") == 0
    m.observe({"event": "hold_end", "reason": "sync overdue", "held_s": 3.5, "time": 4.5,
               "push": {"accepted": True, "ok": True, "push_s": 0.1, "wait_s": 0.2,
                        "pull_s": 0.1}})
    assert value(reg, "dips_holding") == 0 and value(reg, "dips_hold_seconds_total") == 3.5
    assert value(reg, "dips_cluster_events_total", event="hold") == 1
    assert value(reg, "dips_syncs_total", result="accepted") == 1  # the sync that ended it


def test_follower_calls_checkpoints_and_state(tmp_path):
    reg = CollectorRegistry()
    m = FollowerMetrics(reg)
    shard = FakeShard()
    timed = m.timed(shard)
    assert timed.score(1, ["a"]) == [("a", True, 1.0, "")] and shard.calls == ["score"]
    with pytest.raises(ValueError):
        timed.commit(5)
    assert timed.version == 4  # attributes pass through
    assert value(reg, "dips_follower_call_seconds_count", call="score") == 1
    assert value(reg, "dips_follower_call_seconds_count", call="commit") == 1  # failures too
    m.on_checkpoint(4, 0.25)
    assert value(reg, "dips_checkpoint_seconds_sum") == 0.25
    ckpt = tmp_path / "checkpoints"
    (ckpt / "v000004").mkdir(parents=True)
    (ckpt / "v000004" / "meta.json").write_text("{}")
    now = [0.0]
    busy = BusyTime(clock=lambda: now[0])
    now[0] = 10.0
    busy.add("push", 2.0)
    now[0] = 20.0
    busy.add("update", 1.0)
    now[0] = 30.0  # 3 s busy of the 30 s since the start
    refusals = Refusals()
    for reason in ("unknown_key", "unknown_key", "busy"):
        refusals(reason)
    data = SimpleNamespace(pull_stats=lambda: {"bytes_received": 1000, "bytes_sent": 3000,
                                               "push_streams": 2, "streams": 1,
                                               "inq_bytes": 10, "pullq_bytes": 0},
                           refusals=refusals,
                           waits=lambda: {"data-consumer": 1.5, "data-producer": 0.0},
                           busy=busy)
    m.attach(shard, data, ckpt)
    assert value(reg, "dips_version") == 4 and value(reg, "dips_prepared_version") == -1
    assert value(reg, "dips_bytes_received_total") == 1000
    assert value(reg, "dips_bytes_sent_total") == 3000
    assert value(reg, "dips_pushes_in_flight") == 2 and value(reg, "dips_pulls_in_flight") == 1
    assert value(reg, "dips_data_plane_refused_total", reason="unknown_key") == 2
    assert value(reg, "dips_data_plane_refused_total", reason="busy") == 1
    assert value(reg, "dips_data_plane_wait_seconds", worker="data-consumer") == 1.5
    assert value(reg, "dips_data_plane_queued_bytes", worker="data-consumer") == 10
    assert value(reg, "dips_checkpoint_version") == 4
    assert 0 <= value(reg, "dips_checkpoint_age_seconds") < 3600
    assert value(reg, "dips_follower_idle_ratio") == pytest.approx(0.9)  # review 28 #6
    assert value(reg, "dips_follower_busy_seconds_total", phase="push") == 2.0
    now[0] = 100.0  # the window is the last 60 s: nothing busy in it
    assert value(reg, "dips_follower_idle_ratio") == 1.0
    assert value(reg, "dips_follower_busy_seconds_total", phase="update") == 1.0


def test_the_endpoint_serves_its_own_registry_on_a_free_port():
    reg = CollectorRegistry()
    LeaderMetrics(reg).observe("outer_steps", DECISION)
    server = serve_metrics(reg, 0, "127.0.0.1")
    try:
        assert server.port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        pushes = {(s.labels["result"], s.labels["reason"]): s.value
                  for s in families["dips_pushes"].samples if s.name == "dips_pushes_total"}
        assert pushes == {("accepted", "none"): 2.0, ("rejected", "penalty"): 1.0}
        assert families["dips_phase_seconds"].type == "histogram"
        assert "python_gc_objects_collected" not in families  # not the global registry
        with pytest.raises(RoleError, match="--metrics-port"):
            serve_metrics(CollectorRegistry(), server.port, "127.0.0.1")
    finally:
        server.close()
    assert isinstance(server, MetricsServer)


def test_no_counter_or_histogram_has_a_created_series():
    """Review 15, #12: every counter and histogram had a ``*_created`` series besides its
    value (one more series per label set in each scrape)."""
    registries = []
    for kind in (LeaderMetrics, ClusterMetrics, FollowerMetrics):
        reg = CollectorRegistry()
        m = kind(reg)
        registries.append(reg)
        if kind is LeaderMetrics:
            m.observe("outer_steps", DECISION)
            m.observe("outer_steps", ROUND_END)
        elif kind is ClusterMetrics:
            m.observe({"step": 1, "loss": 3.0, "tokens": 64, "compute_s": 0.1, "time": 1.0})
    names = [s.name for reg in registries for f in reg.collect() for s in f.samples]
    assert "dips_pushes_total" in names and "dips_phase_seconds_count" in names
    assert "dips_inner_steps_total" in names
    assert [n for n in names if n.endswith("_created")] == []


def test_json_log_lines_carry_time_level_logger_message_and_extras():
    fmt = JsonFormatter("follower-0")
    record = logging.LogRecord("dips.node.follower", logging.WARNING, __file__, 1,
                               "follower %d: %s", (0, "late"), None)
    record.cluster = "a"
    record.path = Path("/x")
    doc = json.loads(fmt.format(record))
    assert doc["level"] == "WARNING" and doc["logger"] == "dips.node.follower"
    assert doc["message"] == "follower 0: late" and doc["process"] == "follower-0"
    assert doc["cluster"] == "a" and doc["path"] == repr(Path("/x"))
    assert isinstance(doc["time"], float)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import sys

        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    doc = json.loads(fmt.format(record))
    assert "RuntimeError: boom" in doc["exc_info"] and "\n" not in fmt.format(record)


def test_a_refused_start_is_a_json_line_under_log_format_json(tmp_path):
    """Review 15 #7: with --log-format json, a refused start (here a state directory in use)
    was the one plain-text line on stderr; now it is a JSON object too."""
    import subprocess
    import sys

    from dips.emu.launcher import free_port
    from dips.node.common import StateDir

    state = tmp_path / "f0"
    state.mkdir()
    lock = StateDir(state).acquire()  # another process holds it (the lock is per open file)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "dips.cli", "follower", "--leader", "127.0.0.1:9", "--index",
             "0", "--listen", f"127.0.0.1:{free_port()}", "--data-listen",
             f"127.0.0.1:{free_port()}", "--state-dir",
             str(state), "--insecure", "--log-format", "json"],
            capture_output=True, text=True, timeout=100)
    finally:
        lock.release()
    assert proc.returncode == 2, proc.stderr
    lines = [json.loads(l) for l in proc.stderr.splitlines() if l.startswith("{")]
    assert lines and lines[-1]["level"] == "ERROR" and lines[-1]["exit_code"] == 2
    assert "is in use" in lines[-1]["message"], proc.stderr
    assert all(l.startswith("{") for l in proc.stderr.splitlines() if l.strip()
               and not l.startswith("WARNING: running WITHOUT TLS")), proc.stderr


def test_a_leader_event_logs_its_fields_as_json_fields(caplog):
    """Review 15 #7: under --log-format json a leader event's fields were a Python dict repr
    inside ``message``; they are a JSON object now (``event``, ``fields``)."""
    from dips.roles import leader_records

    caplog.set_level(logging.INFO, logger=leader_records.log.name)
    stub = SimpleNamespace(_faults=lambda: None, _run_dir=None, _observe=lambda *a: None)
    leader_records.Records.event(stub, "follower_up", follower=1, restarted=False)
    doc = json.loads(JsonFormatter("leader").format(caplog.records[-1]))
    assert doc["event"] == "follower_up" and doc["fields"] == {"follower": 1, "restarted": False}
