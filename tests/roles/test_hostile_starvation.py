"""Review 21, F1: a follower whose data plane was starved (threads alive, serving nothing)
stayed "up": only a dead thread was reported. The data server now reports a connection that
waited beyond ``starved_s`` for its turn (:meth:`DataServer.health`), the follower sends that
as ``data_plane_error`` in its heartbeat, and the leader marks it down until it clears."""

from __future__ import annotations

import json
import threading

import pytest
import zmq

from dips.algo.refusal import Refusal, Refused
from dips.roles.leader import FollowerEntry, Leader, LeaderConfig
from dips.spec import GraceConfig, MembershipConfig, Timeouts
from dips.wire.dataclient import MSG
from dips.wire.dataplane import DataClient, DataServer
from dips.wire.frames import encode
from dips.wire.keys import Keyring
from tests.fuzz.hostile import SECRET, key_of, wait_for
from tests.fuzz.test_fuzz_control import FakeFollower

pytestmark = pytest.mark.timeout(120)


def test_a_connection_waiting_beyond_starved_s_makes_the_server_unhealthy_until_served():
    release, held = threading.Event(), threading.Event()

    def handler(msg):
        if msg.header.get("op") == "slow":
            held.set()
            assert release.wait(60)  # the consumer is stuck (a lock, a hostile input)
            raise Refused(Refusal.BUSY, "slow")
        return {"op": "ok"}, ()

    server = DataServer(Keyring(SECRET), handler, starved_s=0.2).start()
    h = key_of("h")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        assert server.health() is None and server.healthy()
        sock.send_multipart([MSG, h.key_id.encode(), *encode(h.key, {"op": "slow"})])
        wait_for(held.is_set, what="the consumer held")
        assert server.error is None  # every thread lives
        got = {}

        def honest() -> None:
            with DataClient(key_of("a"), server.endpoint, timeout_s=60) as c:
                got["reply"] = c.request({"op": "x"}).header

        t = threading.Thread(target=honest, daemon=True)
        t.start()
        wait_for(lambda: server.health() is not None, what="the starvation reported")
        assert "data-consumer starved" in server.health() and not server.healthy()
        assert server.waits()["data-consumer"] > 0.2
        release.set()
        t.join(60)
        assert got["reply"] == {"op": "ok"}
        wait_for(lambda: server.health() is None, what="the starvation cleared")
    finally:
        release.set()
        sock.close(0)
        server.stop()


def test_the_leader_marks_a_starved_follower_down_and_up_again_once_it_serves(tmp_path):
    cfg = LeaderConfig(followers=1, grace=GraceConfig(window_s=0.0),
                       membership=MembershipConfig(heartbeat_interval_s=5.0, missed_heartbeats=60),
                       timeouts=Timeouts(push_s=1.0, pull_s=1.0))
    leader = Leader(cfg, connect=lambda e: FakeFollower(), run_dir=tmp_path)

    def beat(error: str = "") -> None:
        leader.register_follower(FollowerEntry(0, "tcp://127.0.0.1:1", "", ["l0"], [4], 7,
                                               data_plane_error=error))

    beat()
    assert leader.followers[0].up
    starved = "data-consumer starved: a connection has waited 42 s for its turn (at most 30 s)"
    beat(starved)
    beat(starved)  # one event, not one per heartbeat
    assert not leader.followers[0].up and leader.needs_reconcile
    beat()
    assert leader.followers[0].up
    events = [json.loads(line) for line in (tmp_path / "leader_events.jsonl").read_text()
              .splitlines()]
    down = [e for e in events if e.get("event") == "follower_down"]
    assert len(down) == 1 and down[0]["cause"] == "data plane" and "starved" in down[0]["error"]
    assert [e["event"] for e in events if e.get("event", "").startswith("follower_")] == \
        ["follower_up", "follower_down", "follower_up"]
