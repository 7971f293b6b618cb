"""Review 25, M2: a push delivered late under a grant the leader had already decided (its
verdict "layers missing") was still staged at the followers (held until the cluster's next
push). A push id the leader names in ``Score`` is decided: chunks sent under it later are
refused STALE_GRANT and nothing is staged. A push the leader decided as *not delivered*
(reported failed, timed out) was never named (``Score`` carried the delivered ones only): its
chunks sent ahead of their round were still staged, held until the member's next push. The
round's not-delivered pushes are now named too (``ScoreRequest.retired_push_ids``)."""

from __future__ import annotations

import pytest

from dips.algo.penalty import PenaltyState
from dips.algo.refusal import Refusal, Refused
from dips.algo.round import Slot
from dips.roles.outer_step import run_update
from dips.spec import OuterConfig, PenaltyConfig
from dips.wire import fields
from dips.wire.control import make_server
from dips.wire.pb import control_pb2 as pb
from dips.wire.pb import control_pb2_grpc as pbg
from dips.wire.pki import Identity
from dips.wire.security import Credentials
from dips.wire.services import FollowerControlClient, FollowerServicer
from tests.fuzz.hostile import LAYERS, head, local, pid, pool_live, shard, step
from tests.roles.test_hostile_follower import _code, _single, _stream

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("stage", [True, False], ids=["sent-ahead", "round-push"])
@pytest.mark.parametrize("send", [_stream, _single], ids=["stream", "single"])
def test_chunks_of_a_decided_push_id_are_stale_and_nothing_is_staged(stage, send):
    s = shard()
    (c, valid, sq, err), = s.score(1, ["h"], [pid(7)])  # the leader decides push 7 of h
    assert (c, valid, sq) == ("h", False, 0.0) and "layers missing" in err
    for layer in LAYERS:  # then its chunks arrive
        h = head("h", 1, layer, pid(7), stage=stage)
        assert _code(send, s, h, local(3)) is Refusal.STALE_GRANT
    assert pid(7) not in s._early and (1, "h") not in s._staged
    assert pool_live(s) == 0
    for layer in LAYERS:  # the next grant of h is served as before
        _stream(s, head("h", 2, layer, pid(8)), local(1))
    assert step(s, 2, ["h"], [100])


@pytest.mark.parametrize("others", [False, True], ids=["alone", "beside-a-delivered-push"])
@pytest.mark.parametrize("send", [_stream, _single], ids=["stream", "single"])
def test_a_push_decided_as_not_delivered_is_retired_and_its_late_chunks_are_stale(others, send):
    s = shard()
    # h's push 7 was sent ahead of its round; one layer arrived, then h reported it failed,
    # and it joined round 1 as not delivered
    _stream(s, head("h", 1, "a", pid(7), stage=True), local(3))
    assert pid(7) in s._early
    slots = [Slot("h", pid(7), 0, 100, 0.0, round=1, admitted_at=0.0, done=True, ok=False,
                  error="push failed", ahead=True)]
    if others:  # a's push 8 of the same round was delivered
        for layer in LAYERS:
            _stream(s, head("a", 1, layer, pid(8)), local(1))
        slots.append(Slot("a", pid(8), 0, 100, 0.0, round=1, admitted_at=0.0, done=True,
                          ok=True))
    report = run_update([(0, s)], 1, slots, 0, PenaltyState(), PenaltyConfig(), OuterConfig())
    assert not report.failed and report.outcome.accepted == (("a",) if others else ())
    assert pid(7) not in s._early  # what it had staged is dropped at the decision
    # its other layer arrives after the decision: refused, nothing staged
    assert _code(send, s, head("h", 1, "b", pid(7), stage=True), local(3)) is Refusal.STALE_GRANT
    assert pid(7) not in s._early and pool_live(s) == 0
    # h's next grant is served as before
    for layer in LAYERS:
        _stream(s, head("h", 2, layer, pid(9)), local(2))
    assert step(s, 2, ["h"], [100])


def test_the_retired_push_ids_are_checked_as_every_push_id():
    r = pb.ScoreRequest(round=3, cluster_ids=["a"], push_ids=[pid(1)],
                        retired_push_ids=[pid(2), pid(3)])
    assert fields.score_request(r) == (3, ["a"], [pid(1)], [pid(2), pid(3)])
    with pytest.raises(Refused, match="retired_push_ids") as err:
        fields.score_request(pb.ScoreRequest(round=3, retired_push_ids=["../x"]))
    assert err.value.code is Refusal.INVALID_ARGUMENT


class _AnyTerm:
    def check(self, term: int) -> None:
        pass


def test_the_leaders_score_call_retires_them_over_grpc():
    """The field travels: the leader's client sends it, the follower's servicer passes it on."""
    s = shard()
    _stream(s, head("h", 1, "a", pid(7), stage=True), local(3))
    server = make_server(max_workers=2)
    pbg.add_FollowerServicer_to_server(FollowerServicer(s, _AnyTerm()), server)
    port = Credentials.insecure(Identity.follower(0)).add_port(server, "127.0.0.1:0")
    server.start()
    client = FollowerControlClient(f"127.0.0.1:{port}", Credentials.insecure(Identity.leader()),
                                   0, 1, timeout_s=20)
    try:
        assert client.score(1, [], [], [pid(7)]) == []
        assert pid(7) not in s._early
        assert _code(_stream, s, head("h", 1, "b", pid(7), stage=True)) is Refusal.STALE_GRANT
    finally:
        client._c.close()
        assert server.stop(grace=1.0).wait(10)
