"""Review 21, F3 (the leader): each refused ``RequestPush(base_version=0)`` of a member wrote an
INFO line ("claimed base version 0 below N") before its refusal: leader.log grew 109 to 195
KB/s. Now refusals are counted by (caller, method, code) in ``dips_refusals_total`` and
logged at most once per (caller, code) per interval, and the leader's corrections of a claim
once per (member, kind). The servicer is called directly (in process); the log limiters run
on the test's clock, which stands still: every call falls in one interval."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from dips.algo.refusal import Refusal
from dips.node.metrics import LeaderMetrics
from dips.roles import leader_push
from dips.wire import services
from dips.wire.pb import control_pb2 as pb
from dips.wire.ratelog import RateLimitedLog
from dips.wire.services import LeaderServicer
from tests.roles.test_hostile_leader import ManualClock, make_leader
from tests.servicer_context import Aborted, FakeContext

pytestmark = pytest.mark.timeout(120)
N = 500


def test_n_refused_push_requests_write_one_line_each_kind_and_are_counted(tmp_path, caplog):
    clock = ManualClock()
    leader, _ = make_leader(tmp_path, clock=clock)
    leader._claims = RateLimitedLog(leader_push.log, 60.0, clock=clock)
    servicer = LeaderServicer(leader, None)
    servicer._refusal_log = RateLimitedLog(services.log, 60.0, clock=clock)
    me = FakeContext("cluster-c")
    try:
        servicer.JoinCluster(pb.JoinRequest(stages=[pb.StageLayers(layers=["l0", "l1"])]), me)
        with leader._cond:  # as after outer steps the member saw: it holds version 3 at least
            leader.version = leader.clusters["c"].floor_version = 3
        request = pb.PushRequest(base_version=0, tokens=1)  # nothing trained, base 0 < 3
        codes = []
        with caplog.at_level(logging.INFO):
            for _ in range(N):
                try:
                    servicer.RequestPush(request, me)
                except Aborted as e:
                    codes.append(e.refusal)
            clock.advance(60.0)  # the next interval: one more line of each, saying how many
            for _ in range(2):
                with pytest.raises(Aborted):
                    servicer.RequestPush(request, me)
        assert codes == [Refusal.NOTHING_TRAINED] * N
        lines = [r.getMessage() for r in caplog.records]
        claimed = [m for m in lines if "claimed base version 0 below 3" in m]
        refused = [m for m in lines if m.startswith("refused cluster-c RequestPush")]
        assert len(claimed) == len(refused) == 2, lines[:5]
        assert f"(and {N - 1} more like it in the last 60 s)" in claimed[1]
        assert f"(and {N - 1} more like it in the last 60 s)" in refused[1]
        assert servicer.refusals.counts() == {
            ("cluster-c", "RequestPush", "NOTHING_TRAINED"): N + 2}

        registry = CollectorRegistry()
        LeaderMetrics(registry).attach(leader, clock=clock, refusals=servicer.refusals)
        assert registry.get_sample_value("dips_refusals_total", {
            "member": "cluster-c", "method": "RequestPush",
            "reason": "NOTHING_TRAINED"}) == N + 2
    finally:
        leader.stop()


def test_a_refusal_of_an_unknown_caller_is_counted_too(tmp_path):
    leader, _ = make_leader(tmp_path)
    servicer = LeaderServicer(leader, None)
    try:
        nobody = FakeContext("cluster-c")
        nobody._meta = ()  # no certificate and no identity
        with pytest.raises(Aborted) as info:
            servicer.Heartbeat(pb.HeartbeatRequest(), nobody)
        assert info.value.refusal is Refusal.FORBIDDEN
        assert servicer.refusals.counts() == {("(unknown)", "Heartbeat", "FORBIDDEN"): 1}
    finally:
        leader.stop()
