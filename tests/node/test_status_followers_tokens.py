"""``dips status`` as review 33 of issue 15 (m1) found it: tokens trained shown below tokens
accepted for a cluster whose heartbeat lagged its push; right after a leader restart zeros and
nulls for every cluster, and "1 of 1 followers ready" in a 2-follower run."""

from __future__ import annotations

import math

import pytest
from rich.console import Console

from dips.node.status import Faults, snapshot
from dips.node.status_cli import render
from dips.roles.leader import Leader
from dips.wire.pb import control_pb2 as pb
from dips.wire.status_msg import status_reply
from tests.roles.test_leader_exactly_once import Run

pytestmark = pytest.mark.timeout(60)


def _reply(**kw) -> pb.StatusReply:
    base = dict(version=40, rounds=41, phase="idle", outer_steps=40, followers_ready=2,
                fault_window_s=3600.0, followers_configured=2,
                clusters=[pb.ClusterStatus(cluster_id="c", inner_step=301, tokens=77_056,
                                           last_loss=4.5, last_push="accepted",
                                           pulled_version=40, tokens_accepted=77_824,
                                           tokens_pushed=79_872)],
                followers=[pb.FollowerInfo(index=i, control_endpoint=f"h:{i}", incarnation=3)
                           for i in (0, 1)],
                follower_health=[pb.FollowerHealth(index=i, up=True) for i in (0, 1)])
    base.update(kw)
    return pb.StatusReply(**base)


def _screen(doc: dict) -> str:
    console = Console(record=True, width=160, color_system=None)
    console.print(render(doc))
    return console.export_text()


def test_tokens_trained_are_never_below_tokens_accepted():
    doc = snapshot(_reply(), "l:1", 1000.0)
    (c,) = doc["clusters"]
    assert c["tokens"] == 77_056  # as its last heartbeat said
    assert c["tokens_trained"] == 79_872 >= c["tokens_accepted"]  # what it pushed, at least
    row = next(line for line in _screen(doc).splitlines() if line.lstrip().startswith("c "))
    assert "79,872" in row and "77,056" not in row


def test_the_follower_count_is_the_runs_not_who_has_registered():
    one = _reply(followers_ready=1, followers=[_reply().followers[0]],
                 follower_health=[_reply().follower_health[0]])
    faults = Faults()
    doc = snapshot(one, "l:1", 1000.0)
    conditions = faults.update(doc)
    assert (doc["followers_ready"], doc["followers_total"]) == (1, 2)
    assert [(f["index"], f["registered"], f["up"]) for f in doc["followers"]] == [
        (0, True, True), (1, False, False)]
    assert [c["detail"] for c in conditions if c["kind"] == "follower_down"] == [
        "1 of 2 followers ready"]
    text = _screen(doc)
    assert "followers (1 of 2 ready)" in text and "not registered" in text
    later = faults.update(snapshot(_reply(), "l:1", 1002.0))  # follower 1 registered: no restart
    assert not [c for c in later if c["kind"] == "follower_restarted"]
    older = snapshot(_reply(followers_configured=0), "l:1", 1000.0)  # an older leader
    assert older["followers_total"] == 2


def test_a_restarted_leader_shows_each_members_last_progress_and_the_runs_followers(tmp_path):
    run = Run(tmp_path)
    try:
        run.member("a")
        run.leader.heartbeat = lambda *a, **k: None  # the harness's own heartbeats: off
        Leader.heartbeat(run.leader, "a", 12, 3072, 4.25)
        run.leader.pull_done("a", 0)
        run.leader.checkpoint()
    finally:
        run.close()
    restarted = Leader(run.leader.cfg, connect=lambda e: run.fakes[e.index], run_dir=tmp_path)
    msg = status_reply(restarted.status(), None)
    (a,) = msg.clusters
    assert (a.inner_step, a.tokens, a.pulled_version, a.last_loss) == (12, 3072, 0, 4.25)
    assert msg.followers_configured == 2 and len(msg.followers) == 0  # none registered yet
    doc = snapshot(msg, "l:1", 1000.0)
    assert doc["followers_total"] == 2 and doc["clusters"][0]["staleness"] == 0
    assert not math.isnan(doc["clusters"][0]["last_loss"])
