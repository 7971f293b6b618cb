"""``dips status`` (issue 15): the JSON object and the screen of a hand-made StatusReply, the
faults derived from successive answers, and the command against a live leader behind a real
gRPC server on 127.0.0.1 (insecure identities, and mutual TLS with the operator's bundle)."""

from __future__ import annotations

import json
import math
import socket
import threading
import time

import pytest
from rich.console import Console
from typer.testing import CliRunner

from dips.cli import app
from dips.node.status import Faults, snapshot, staleness
from dips.node.status_cli import NoStatus, _json_line, render, watch
from dips.roles.leader import FollowerEntry
from dips.wire.control import make_server
from dips.wire.pb import control_pb2 as pb
from dips.wire.pb import control_pb2_grpc as pbg
from dips.wire.pki import init_pki
from dips.wire.security import Credentials
from dips.wire.services import LeaderServicer
from tests.roles.test_hostile_leader import Site, make_leader

pytestmark = pytest.mark.timeout(120)

TOP = {"leader", "time", "reachable", "version", "outer_steps", "rounds", "phase", "finished",
       "finished_reason", "counts", "ledger", "followers_ready", "followers_total", "clusters",
       "followers", "heldout", "faults", "fault_counts", "fault_window_s", "conditions"}
CLUSTER = {"cluster_id", "inner_step", "tokens", "tokens_trained", "tokens_accepted",
           "tokens_pushed",
           "last_loss", "last_push", "pulled_version", "staleness", "heartbeat_age_s"}
FOLLOWER = {"index", "registered", "up", "version", "incarnation", "control_endpoint",
            "data_endpoint",
            "layers", "heartbeat_age_s"}
COUNTS = {"updates_pushed", "updates_accepted", "updates_rejected", "tokens_pushed",
          "tokens_accepted", "outer_steps_lost"}


def reply(**kw) -> pb.StatusReply:
    """Version 7; clusters a (pulled 7), b (pulled 4, rejected), c (never pulled); 2 followers."""
    base = dict(
        version=7, rounds=9, phase="window", outer_steps=7, updates_pushed=12,
        updates_accepted=10, updates_rejected=2, tokens_pushed=1200, tokens_accepted=1000,
        outer_steps_lost=0, followers_ready=2, accepted_windows=40, ledger_epoch=1,
        clusters=[pb.ClusterStatus(cluster_id="b", inner_step=30, tokens=300, last_loss=4.25,
                                   last_push="rejected", pulled_version=4),
                  pb.ClusterStatus(cluster_id="a", inner_step=50, tokens=500, last_loss=3.5,
                                   last_push="accepted", pulled_version=7),
                  pb.ClusterStatus(cluster_id="c", inner_step=0, tokens=0, last_loss=math.nan,
                                   last_push="-", pulled_version=-1)],
        followers=[pb.FollowerInfo(index=1, control_endpoint="h:2", data_endpoint="tcp://h:3",
                                   layers=["l2"], incarnation=5),
                   pb.FollowerInfo(index=0, control_endpoint="h:0", data_endpoint="tcp://h:1",
                                   layers=["l0", "l1"], incarnation=4)])
    base.update(kw)
    return pb.StatusReply(**base)


def test_the_json_object_has_stable_keys_and_staleness_is_version_minus_pulled():
    doc = snapshot(reply(), "10.0.0.5:7000", 1000.0)
    assert set(doc) == TOP and set(doc["counts"]) == COUNTS
    assert set(doc["ledger"]) == {"epoch", "accepted_windows"}
    assert all(set(c) == CLUSTER for c in doc["clusters"])
    assert all(set(f) == FOLLOWER for f in doc["followers"])
    by_id = {c["cluster_id"]: c for c in doc["clusters"]}
    assert [c["cluster_id"] for c in doc["clusters"]] == ["a", "b", "c"]
    assert (by_id["a"]["staleness"], by_id["b"]["staleness"], by_id["c"]["staleness"]) == (0, 3, None)
    assert by_id["c"]["pulled_version"] is None and by_id["c"]["last_loss"] is None
    assert by_id["b"] == {"cluster_id": "b", "inner_step": 30, "tokens": 300,
                          "tokens_trained": 300, "tokens_accepted": 0, "tokens_pushed": 0, "last_loss": 4.25,
                          "last_push": "rejected", "pulled_version": 4, "staleness": 3,
                          "heartbeat_age_s": None}  # an older leader: no ages, no faults
    assert (doc["fault_window_s"], doc["faults"], doc["fault_counts"]) == (None, [], [])
    assert [(f["index"], f["up"], f["version"], f["layers"]) for f in doc["followers"]] == \
        [(0, True, None, 2), (1, True, None, 1)]
    assert (doc["leader"], doc["version"], doc["finished"], doc["finished_reason"]) == \
        ("10.0.0.5:7000", 7, False, "")
    assert json.loads(json.dumps(doc, allow_nan=False)) == doc  # no NaN reaches a script


def test_followers_up_is_known_only_when_the_ready_count_decides_it():
    assert {f["up"] for f in snapshot(reply(followers_ready=0), "l:1", 0.0)["followers"]} == {False}
    assert {f["up"] for f in snapshot(reply(followers_ready=1), "l:1", 0.0)["followers"]} == {None}
    assert staleness(5, -1) is None and staleness(5, 2) == 3


def test_the_screen_shows_every_member_its_staleness_and_the_finish():
    doc = snapshot(reply(finished="token budget reached"), "10.0.0.5:7000", 1000.0)
    Faults().update(doc)
    console = Console(record=True, width=150, color_system=None)
    console.print(render(doc))
    text = console.export_text()
    assert "finished: token budget reached" in text and "version 7" in text
    rows = {cells[0]: cells for line in text.splitlines()
            if (cells := [c for c in line.split() if c != "│"])}
    assert rows["a"][-4:] == ["accepted", "7", "0", "-"]  # heartbeat age: not sent
    assert rows["b"][-4:-1] == ["rejected", "4", "3"] and rows["c"][-3:] == ["-", "-", "-"]
    assert "push_rejected" in text and "cluster-b" in text


def test_one_answer_shows_the_faults_that_hold_now():
    faults = Faults().update(snapshot(reply(followers_ready=1), "l:1", 1000.0))
    assert {(f["kind"], f["member"], f["active"]) for f in faults} == {
        ("follower_down", "followers", True), ("push_rejected", "cluster-b", True)}
    assert next(f for f in faults if f["kind"] == "follower_down")["detail"] == \
        "1 of 2 followers ready"


def test_successive_answers_show_removals_restarts_losses_and_quiet_clusters():
    faults = Faults(quiet_after_s=60.0, window_s=3600.0)
    faults.update(snapshot(reply(), "l:1", 1000.0))
    gone_b = reply(clusters=[reply().clusters[1], reply().clusters[2]], outer_steps_lost=2,
                   followers=[reply().followers[0], pb.FollowerInfo(index=0, incarnation=6)])
    seen = {(f["kind"], f["member"]): f for f in faults.update(snapshot(gone_b, "l:1", 1010.0))}
    assert set(seen) == {("cluster_gone", "cluster-b"), ("follower_restarted", "follower-0"),
                         ("outer_steps_lost", "leader"), ("push_rejected", "cluster-b")}
    assert seen["follower_restarted", "follower-0"]["detail"] == "incarnation 4 -> 6"
    assert not seen["push_rejected", "cluster-b"]["active"]  # b is gone: no verdict now
    seen = {(f["kind"], f["member"]): f for f in faults.update(snapshot(gone_b, "l:1", 1070.0))}
    assert seen["cluster_gone", "cluster-b"]["active"]  # still absent
    assert seen["cluster_gone", "cluster-b"]["since"] == 1010.0
    assert not seen["follower_restarted", "follower-0"]["active"]
    assert seen["no_progress", "cluster-a"]["detail"] == "inner step 50 for 70 s"
    assert ("no_progress", "cluster-c") in seen
    moved = reply(clusters=[pb.ClusterStatus(cluster_id="a", inner_step=51, pulled_version=7)],
                  followers=gone_b.followers, outer_steps_lost=2)
    later = {(f["kind"], f["member"]): f
             for f in faults.update(snapshot(moved, "l:1", 1080.0 + 3600.0))}  # an hour on
    assert set(later) == {("cluster_gone", "cluster-b"), ("cluster_gone", "cluster-c")}
    assert later["cluster_gone", "cluster-b"]["since"] == 1010.0  # it still holds: it stays


def test_a_finished_run_lists_no_cluster_as_quiet():
    faults = Faults(quiet_after_s=60.0)
    faults.update(snapshot(reply(finished="token budget reached"), "l:1", 1000.0))
    later = faults.update(snapshot(reply(finished="token budget reached"), "l:1", 2000.0))
    assert {f["kind"] for f in later} == {"push_rejected"}


def test_clusters_leaving_a_finished_run_are_not_gone():
    """Review of issue 15, #8: a normal finish showed every cluster as an active
    ``cluster_gone``: they leave once the leader says the run finished."""
    faults = Faults(quiet_after_s=60.0)
    faults.update(snapshot(reply(finished="token budget"), "l:1", 1000.0))
    left = reply(finished="token budget", clusters=[])
    assert [f for f in faults.update(snapshot(left, "l:1", 1002.0))
            if f["kind"] == "cluster_gone"] == []
    faults = Faults(quiet_after_s=60.0)  # while it runs, a cluster that leaves is gone
    faults.update(snapshot(reply(), "l:1", 1000.0))
    gone = faults.update(snapshot(reply(clusters=[]), "l:1", 1002.0))
    assert {f["member"] for f in gone if f["kind"] == "cluster_gone" and f["active"]} == {
        "cluster-a", "cluster-b", "cluster-c"}


def test_a_finish_revives_no_earlier_removal_and_hides_a_leave_just_before_it():
    """Review 26, M1: a cluster removed earlier and back again (an inactive ``cluster_gone``)
    came back active on the look that first said finished, with no cluster listed; and the
    leader may record ``cluster_left b`` a few ms before ``run_finished``."""
    faults = Faults(quiet_after_s=600.0, window_s=3600.0)
    faults.update(snapshot(reply(), "l:1", 1000.0))
    faults.update(snapshot(reply(clusters=[reply().clusters[1], reply().clusters[2]]),
                           "l:1", 1001.0))  # b removed while the run goes on
    faults.update(snapshot(reply(), "l:1", 1002.0))  # b back: the condition is inactive
    left_b = reply(clusters=[reply().clusters[1], reply().clusters[2]])
    gone = faults.update(snapshot(left_b, "l:1", 1003.0))  # b left a few ms before the finish
    assert [f["member"] for f in gone if f["kind"] == "cluster_gone" and f["active"]] == [
        "cluster-b"]
    for t in (1004.0, 1005.0):
        done = faults.update(snapshot(reply(finished="max time", clusters=[]), "l:1", t))
        assert [f for f in done if f["kind"] == "cluster_gone" and f["active"]] == []


def test_watch_json_prints_a_record_while_the_leader_is_unreachable(capsys):
    """Review of issue 15, #8: ``--watch --json`` printed nothing while the leader was down."""
    answers = [NoStatus("leader l:1: UNAVAILABLE"), snapshot(reply(), "l:1", 1000.0),
               NoStatus("leader l:1: DEADLINE_EXCEEDED")]
    stop = threading.Event()

    def look():
        got = answers.pop(0)
        if not answers:
            stop.set()
        if isinstance(got, Exception):
            raise got
        return got

    watch(look, lambda doc, err: _json_line("l:1", doc, err), 0.0, stop)
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(d["reachable"], d.get("error")) for d in out] == [
        (False, "leader l:1: UNAVAILABLE"), (True, None),
        (False, "leader l:1: DEADLINE_EXCEEDED")]
    assert out[0]["leader"] == "l:1" and out[0]["last_answer"] is None
    assert out[2]["last_answer"] == 1000.0 and out[1]["version"] == 7


def test_watch_keeps_the_last_answer_under_an_error_and_stops_on_the_event():
    answers = [{"n": 1}, NoStatus("leader l:1: UNAVAILABLE"), {"n": 2}]
    shown: list = []
    stop = threading.Event()

    def look():
        got = answers.pop(0)
        if isinstance(got, Exception):
            raise got
        return got

    def show(doc, error):
        shown.append((doc, error))
        if not answers:
            stop.set()

    watch(look, show, 0.0, stop)
    assert shown == [({"n": 1}, ""), ({"n": 1}, "leader l:1: UNAVAILABLE"), ({"n": 2}, "")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, says", [
    (["--leader", "127.0.0.1:1"], "give exactly one of --tls DIR"),
    (["--leader", "nohost", "--insecure"], "--leader = 'nohost' is not HOST:PORT"),
])
def test_bad_options_exit_2_naming_the_option(args, says):
    result = CliRunner().invoke(app, ["status", *args])
    assert result.exit_code == 2 and says in result.stderr


def test_a_leader_that_does_not_answer_exits_1_naming_its_address():
    addr = f"127.0.0.1:{free_port()}"  # nothing listens there
    result = CliRunner().invoke(app, ["status", "--leader", addr, "--insecure", "--json",
                                      "--timeout", "2"])
    assert result.exit_code == 1 and f"leader {addr} as 'admin'" in result.stderr
    said = json.loads(result.stdout)  # a script reads stdout: one object saying so (review 26)
    assert said["reachable"] is False and said["leader"] == addr and addr in said["error"]


def test_status_json_of_a_live_leader_lists_every_member_with_version_and_staleness(tmp_path):
    site = Site(tmp_path)
    try:
        a, b = site.join("cluster-a"), site.join("cluster-b")
        b.PullDone(pb.PullDoneRequest(version=0))  # b holds version 0
        a.Heartbeat(pb.HeartbeatRequest(inner_step=8, tokens=512, last_loss=3.25))
        grant = a.RequestPush(pb.PushRequest(base_version=0, tokens=64))
        site.clock.advance(5.0)  # the grace window closes: a's push alone makes version 1
        verdict = a.PushDone(pb.PushDoneRequest(push_id=grant.push_id, ok=True))
        assert verdict.accepted and verdict.version == 1
        a.PullDone(pb.PullDoneRequest(version=1))
        result = CliRunner().invoke(app, ["status", "--leader", f"127.0.0.1:{site.port}",
                                          "--insecure", "--json"])
        assert result.exit_code == 0, result.output
        doc = json.loads(result.stdout)
        assert set(doc) == TOP and doc["version"] == 1 and doc["outer_steps"] == 1
        got = {c["cluster_id"]: (c["pulled_version"], c["staleness"], c["last_push"])
               for c in doc["clusters"]}
        assert got == {"a": (1, 0, "accepted"), "b": (0, 1, "-")}
        a_row = next(c for c in doc["clusters"] if c["cluster_id"] == "a")
        assert (a_row["inner_step"], a_row["tokens"], a_row["last_loss"]) == (8, 512, 3.25)
        assert [(f["index"], f["up"]) for f in doc["followers"]] == [(0, True)]
        assert doc["counts"]["updates_accepted"] == 1 and doc["faults"] == []
        # Heartbeat ages on the leader's clock (the test's): b was last heard 5 s ago.
        ages = {c["cluster_id"]: c["heartbeat_age_s"] for c in doc["clusters"]}
        assert ages["b"] == 5.0 and 0.0 <= ages["a"] <= 5.0
        assert doc["followers"][0]["heartbeat_age_s"] == 5.0 and doc["fault_window_s"] == 3600
        screen = CliRunner().invoke(app, ["status", "--leader", f"127.0.0.1:{site.port}",
                                          "--insecure"])
        assert screen.exit_code == 0 and "running" in screen.stdout
    finally:
        site.close()


def test_status_over_mutual_tls_with_the_operators_bundle(tmp_path):
    pki = tmp_path / "pki"
    init_pki(pki, 1, ["a"])
    (tmp_path / "leader").mkdir()
    leader, _ = make_leader(tmp_path / "leader")
    server = make_server(max_workers=4)

    def entry(i: pb.FollowerInfo) -> FollowerEntry:
        return FollowerEntry(i.index, i.data_endpoint, i.control_endpoint, list(i.layers),
                             list(i.layer_bytes), i.incarnation)

    pbg.add_LeaderServicer_to_server(LeaderServicer(leader, entry), server)
    port = Credentials.tls(pki / "leader").add_port(server, "127.0.0.1:0")
    server.start()
    try:
        leader.join_cluster("a", [["l0", "l1"]])
        ok = CliRunner().invoke(app, ["status", "--leader", f"127.0.0.1:{port}", "--json",
                                      "--tls", str(pki / "admin")])
        assert ok.exit_code == 0, ok.output
        assert [c["cluster_id"] for c in json.loads(ok.stdout)["clusters"]] == ["a"]
        plain = CliRunner().invoke(app, ["status", "--leader", f"127.0.0.1:{port}", "--json",
                                         "--insecure", "--timeout", "2"])
        assert plain.exit_code == 1 and "--tls/--insecure" in plain.stderr
        missing = CliRunner().invoke(app, ["status", "--leader", f"127.0.0.1:{port}",
                                           "--tls", str(tmp_path / "nowhere")])
        assert missing.exit_code == 2 and "--tls" in missing.stderr
        init_pki(tmp_path / "other", 1, ["a"])  # review 15: another run's bundle
        foreign = CliRunner().invoke(app, ["status", "--leader", f"127.0.0.1:{port}",
                                           "--tls", str(tmp_path / "other" / "admin"),
                                           "--timeout", "3"])
        assert foreign.exit_code == 2, foreign.output
        assert "its certificate is not signed by the CA of this --tls bundle" in foreign.stderr
    finally:
        server.stop(0).wait(5)
        leader.stop()


class _SlowLink:
    """A TCP proxy on 127.0.0.1 that holds every chunk ``delay_s`` before passing it on (a
    WAN's round trip: each direction's chunks are delayed, so a handshake takes several ×)."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.delay_s, self.target = delay_s, ("127.0.0.1", target_port)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                a, _ = self.sock.accept()
            except OSError:
                continue
            b = socket.create_connection(self.target, timeout=10)
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.2)
        try:
            while not self.stop.is_set():
                try:
                    data = src.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                time.sleep(self.delay_s)  # the link's latency, not a wait for an event
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def test_status_connects_over_a_link_with_a_long_round_trip(tmp_path):
    """Review 15, F1: gRPC took the client's 100-ms minimum reconnect backoff as its connect
    timeout too, so TCP + TLS + HTTP/2 had to finish in 100 ms: `dips status` and `dips
    export` failed at once over any link slower than about 50 ms a way."""
    pki = tmp_path / "pki"
    init_pki(pki, 1, ["a"])
    (tmp_path / "leader").mkdir()
    leader, _ = make_leader(tmp_path / "leader")
    server = make_server(max_workers=4)
    pbg.add_LeaderServicer_to_server(LeaderServicer(leader, None), server)
    port = Credentials.tls(pki / "leader").add_port(server, "127.0.0.1:0")
    server.start()
    link = _SlowLink(port, delay_s=0.15)
    try:
        out = CliRunner().invoke(app, ["status", "--leader", f"127.0.0.1:{link.port}",
                                       "--json", "--tls", str(pki / "admin"), "--timeout", "30"])
        assert out.exit_code == 0, out.output
        assert "clusters" in json.loads(out.stdout)
    finally:
        link.close()
        server.stop(0).wait(5)
        leader.stop()
