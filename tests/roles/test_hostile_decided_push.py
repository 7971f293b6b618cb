"""Review 25, M2: a push delivered late under a grant the leader had already decided (its
verdict "layers missing") was still staged at the followers (held until the cluster's next
push). A push id the leader names in ``Score`` is decided: chunks sent under it later are
refused STALE_GRANT and nothing is staged."""

from __future__ import annotations

import pytest

from dips.algo.refusal import Refusal
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
