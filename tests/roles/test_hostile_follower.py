"""A member with a valid key but hostile pushes, against one follower (issue 13).

Each input of the issue's items 1, 3, 4, 6 (follower side) and 7 becomes a test: it is
refused with its code, nothing is allocated for it, the follower keeps serving a legitimate
push and pull, and θ after an honest step is bit-identical to a follower that never saw it.
"""

from __future__ import annotations

import json

import pytest
import torch

from dips.algo.refusal import Refusal, Refused
from dips.roles.follower_admit import MAX_EARLY_PUSHES
from dips.wire.dataplane import DataClient, DataPlaneError
from dips.wire.frames import Message, tensor_bytes
from dips.wire.stream import TensorSpec
from tests.fuzz.hostile import (
    LAYERS,
    head,
    key_of,
    local,
    pid,
    pool_live,
    push_all,
    released,
    served,
    shard,
    step,
    tensors,
)

pytestmark = pytest.mark.timeout(120)


def _code(fn, *args) -> Refusal:
    """The refusal code ``fn(*args)`` raises (a ValueError counts as INVALID_ARGUMENT, as the
    data server answers it)."""
    try:
        fn(*args)
    except Refused as exc:
        return exc.code
    except ValueError:
        return Refusal.INVALID_ARGUMENT
    raise AssertionError(f"{fn.__name__} accepted it")


def _single(s, h, values=None, layer=None):
    layer = layer or h.get("layer")
    return s.handle(Message(dict(h), dict(tensors(layer, values or local(1)))))


def _stream(s, h, values=None, layer=None, commit=True):
    """One streamed layer through the shard's sink, in 1 KiB chunks (as the consumer does)."""
    layer = layer or h["layer"]
    pairs = tensors(layer, values or local(1))
    sink = s.open_push(dict(h), [TensorSpec.of(n, t) for n, t in pairs])
    try:
        for i, (_, t) in enumerate(pairs):
            raw = tensor_bytes(t)
            for off in range(0, len(raw), 1024):
                sink.write(i, off, raw[off:off + 1024])
        if commit:
            sink.commit()
    except ValueError as exc:  # as the data server does: the stream fails, its sink is told
        sink.abort(str(exc))
        raise
    return sink


def _reference(rnd: int = 1, rejected: bool = False) -> str:
    """θ's checksum after an honest round: clusters a and b, T = 100 and 300. ``rejected``:
    a third cluster's push was invalid, so δ is formed when asked rather than from the sum
    formed at receipt (equal in exact arithmetic, not bit for bit)."""
    ref = shard()
    for c, seed, t in (("a", 1, 100), ("b", 2, 300)):
        for layer in LAYERS:
            _stream(ref, head(c, rnd, layer, pid(seed), t), local(seed))
    if rejected:
        _stream(ref, head("c", rnd, "b", pid(3)), local(3))
        assert not ref.score(rnd, ["c"])[0][1]
    return step(ref, rnd, ["a", "b"], [100, 300])


def _honest_round(s, rnd: int = 1) -> str:
    for c, seed, t in (("a", 1, 100), ("b", 2, 300)):
        for layer in LAYERS:
            _stream(s, head(c, rnd, layer, pid(seed), t), local(seed))
    return step(s, rnd, ["a", "b"], [100, 300])


HOSTILE_FIELDS = [  # (field overrides, code): each was an internal error or a dead thread
    ({"layer": ["a"]}, Refusal.INVALID_ARGUMENT),        # item 1: TypeError, consumer died
    ({"tokens": 10**400}, Refusal.INVALID_ARGUMENT),     # item 1: OverflowError
    ({"tokens": 2**63}, Refusal.INVALID_ARGUMENT),
    ({"tokens": True}, Refusal.INVALID_ARGUMENT),
    ({"tokens": 1.5}, Refusal.INVALID_ARGUMENT),
    ({"round": True}, Refusal.INVALID_ARGUMENT),
    ({"round": -1}, Refusal.INVALID_ARGUMENT),
    ({"round": 2**64}, Refusal.INVALID_ARGUMENT),
    ({"round": "1"}, Refusal.INVALID_ARGUMENT),
    ({"layer": "z"}, Refusal.INVALID_ARGUMENT),
    ({"layer": "a" * 100_000}, Refusal.INVALID_ARGUMENT),
    ({"layer": {"a": 1}}, Refusal.INVALID_ARGUMENT),
    ({"push_id": ["x"]}, Refusal.INVALID_ARGUMENT),
    ({"push_id": "x" * 1000}, Refusal.INVALID_ARGUMENT),
    ({"stage": "yes"}, Refusal.INVALID_ARGUMENT),
    ({"stage": 1}, Refusal.INVALID_ARGUMENT),
    ({"op": ["push"]}, Refusal.INVALID_ARGUMENT),
]


def test_malformed_fields_are_refused_by_name_on_both_paths_and_the_follower_keeps_serving():
    s = shard()
    with served(s) as server, DataClient(key_of("a"), server.endpoint, timeout_s=30) as c:
        for extra, code in HOSTILE_FIELDS:
            h = {**head("a", 1, "a", pid(1)), **extra}
            for send in (lambda: c.push(h, tensors("a", local(1)), chunk_bytes=1024),
                         lambda: c.request(h, tensors("a", local(1)))):
                with pytest.raises(DataPlaneError) as info:
                    send()
                assert info.value.code is code, (extra, info.value)
                # A 100 kB layer name is refused by the message's size, before it is parsed
                # (a header of this shard carries at most a few kB: review 21).
                named = "a" * 1000 in str(h["layer"]) and "carries at most" in str(info.value)
                assert named or "field" in str(info.value) or "layer" in str(info.value), info.value
        assert server.healthy() and released(s) and not s._staged
        # A legitimate push and pull go through; the round's step is the honest one, bit for bit.
        push_all(c, local(1), 1, pid(1))
        with DataClient(key_of("b"), server.endpoint, timeout_s=30) as b:
            push_all(b, local(2), 1, pid(2), "b", 300, single=True)
        assert step(s, 1, ["a", "b"], [100, 300]) == _reference()
        out = [(n, torch.empty(t.shape, dtype=torch.bfloat16)) for n, t in tensors("b", s.params)]
        assert c.pull({"op": "pull", "version": 1, "layers": ["b"]}, out)["version"] == 1
        assert torch.equal(out[0][1], s.params["b.w"].to(torch.bfloat16))


@pytest.mark.parametrize("version, layers, dtype", [
    (True, ["a"], "bf16"), (2**63, ["a"], "bf16"), ("0", ["a"], "bf16"),
    (0, "a", "bf16"), (0, ["a", "a"], "bf16"), (0, ["a", "b", "c"], "bf16"),
    (0, [["a"]], "bf16"), (0, ["a"], "int8"), (0, ["a"], ["bf16"]),
])
def test_malformed_pulls_are_refused_by_name(version, layers, dtype):
    s = shard()
    h = {"op": "pull", "version": version, "layers": layers, "dtype": dtype}
    assert _code(s.open_pull, h) is Refusal.INVALID_ARGUMENT
    assert _code(s.handle, Message(h)) is Refusal.INVALID_ARGUMENT


def test_a_push_the_leader_did_not_admit_allocates_nothing():
    """Item 3: invented rounds and clusters, forged or mismatched tickets, no ticket at all:
    refused before any buffer (the issue's 20 invented ids for round 10^9 held 21 buffers)."""
    s = shard()
    forged = head("a", 10**9, "a", pid(7), **{})
    forged["ticket_mac"] = "00" * 32
    cases = [({k: v for k, v in head().items() if k not in ("ticket", "ticket_mac")},
              Refusal.FORBIDDEN),
             (forged, Refusal.FORBIDDEN),
             ({**head("a", 1), "ticket": head("b", 1)["ticket"],
               "ticket_mac": head("b", 1)["ticket_mac"]}, Refusal.FORBIDDEN),  # another's
             ({**head("a", 1), "round": 2}, Refusal.FORBIDDEN),    # another round
             ({**head("a", 1), "push_id": pid(9)}, Refusal.FORBIDDEN),  # another push
             ({**head("a", 0, stage=True), "stage": False}, Refusal.FORBIDDEN),
             ({**head("a", 1), "ticket": "x" * 600}, Refusal.INVALID_ARGUMENT)]
    for n in range(20):  # invented ids, each with a forged ticket
        h = head("a", 10**9, "a", pid(100 + n), key=b"k" * 32)
        cases.append((h, Refusal.FORBIDDEN))
    for h, code in cases:
        assert _code(_stream, s, h) is code, h
        assert _code(_single, s, h) is code, h
    assert not s._staged and not s._sums and not s._early and pool_live(s) == 0
    assert getattr(s, "_pools", None) is None or s._pools[0].allocated == 0
    s.discard(10**9)
    assert pool_live(s) == 0
    unregistered = shard(key=None)  # a follower process before its first registration
    assert _code(_stream, unregistered, head()) is Refusal.NOT_READY


def test_discard_releases_every_buffer_of_its_rounds():
    s = shard()
    for n, c in enumerate(["a", "b", "c"]):
        for layer in LAYERS:
            _stream(s, head(c, 5, layer, pid(n + 1), 100 + n), local(n))
    _stream(s, head("a", 6, "a", pid(9)), local(1))  # the next round's push stays
    assert pool_live(s) >= 4
    s.discard(5)
    assert pool_live(s) == 1 and list(s._staged) == [(6, "a")]
    s.discard(6)
    assert pool_live(s) == 0 and not s._staged and not s._sums


def test_a_huge_declared_tensor_is_refused_before_any_plan_or_buffer():
    """Item 3: a signed BEGIN declaring 2^22 chunks built its plan (1.4 s, +320 MB) before the
    shapes were checked; now the shapes are checked against the shard first."""
    s = shard()
    huge = [TensorSpec("a.w", "bf16", (2**22, 128)), TensorSpec("a.b", "bf16", (30,))]
    with pytest.raises(ValueError, match="shape"):
        s.open_push(head(), huge)
    assert not s._staged.get((1, "a")) or s._staged[(1, "a")].delta is None
    assert pool_live(s) == 0
    assert _honest_round(s, 2) == _reference()


def test_early_pushes_are_bounded_in_total_and_one_per_cluster():
    s = shard()
    for n in range(MAX_EARLY_PUSHES):
        _single(s, head(f"c{n}", stage=True, push_id=pid(n + 1), layer="b"), layer="b")
    assert _code(_single, s, head("late", stage=True, push_id=pid(999), layer="b"),
                 None, "b") is Refusal.BUSY
    # A cluster's newer push replaces its older one, whose id is then used up.
    _single(s, head("c0", stage=True, push_id=pid(500), layer="b"), layer="b")
    assert len(s._early) == MAX_EARLY_PUSHES and pid(1) not in s._early
    assert _code(_single, s, head("c0", stage=True, push_id=pid(1), layer="a"),
                 None, "a") is Refusal.STALE_GRANT


@pytest.mark.parametrize("path", ["single", "stream"])
def test_large_finite_values_are_refused_on_both_paths(path):
    """Item 4: a single-message push of finite 1e30 values was accepted, its score became
    inf, and the whole round failed; both paths now refuse it the same way."""
    s = shard()
    bad = {n: torch.full(t.shape, 1e30, dtype=torch.bfloat16) for n, t in local(3).items()}
    send = _single if path == "single" else _stream
    assert _code(send, s, head("c", 1, "a", pid(3)), bad) is Refusal.INVALID_ARGUMENT
    _stream(s, head("c", 1, "b", pid(3)), local(3))
    for c, seed, t in (("a", 1, 100), ("b", 2, 300)):
        for layer in LAYERS:
            _stream(s, head(c, 1, layer, pid(seed), t), local(seed))
    scores = {c: (valid, sq, err) for c, valid, sq, err in s.score(1, ["a", "b", "c"])}
    assert scores["c"][0] is False and scores["c"][1] == 0.0 and "too large" in scores["c"][2]
    assert all(v[0] and v[1] < float("inf") for c, v in scores.items() if c != "c")
    assert step(s, 1, ["a", "b"], [100, 300]) == _reference(rejected=True)


def test_a_push_sent_ahead_with_huge_values_is_invalid_when_scored():
    s = shard()
    bad = {n: torch.full(t.shape, 1e30, dtype=torch.bfloat16) for n, t in local(3).items()}
    for layer in LAYERS:
        _stream(s, head("c", stage=True, layer=layer, push_id=pid(3)), bad)
    (_, valid, sq, err), = s.score(1, ["c"], [pid(3)])
    assert not valid and sq == 0.0 and "too large" in err


def test_a_verbatim_replay_after_discard_is_refused(tmp_path):
    """Item 6: the same BEGIN, chunks and END bytes sent again after the round was
    discarded were accepted; now they are STALE_GRANT and allocate nothing."""
    import zmq

    from dips.wire.frames import decode
    from dips.wire.stream import StreamWriter

    s = shard()
    key = key_of("a")
    pairs = tensors("a", local(1))
    w = StreamWriter(key.key, head("a", 4, "a", pid(4)), [TensorSpec.of(n, t) for n, t in pairs],
                     1024)
    b = w.begin()
    msgs = [[b[0], key.key_id.encode(), *b[1:]]]
    msgs += [[bytes(p) for p in c] for i, (_, t) in enumerate(pairs) for c in w.chunks(i, t)]
    msgs.append(w.end())
    with served(s) as server:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 30_000)
        sock.connect(server.endpoint)
        try:
            replies = []
            for attempt in range(2):
                for m in msgs:
                    sock.send_multipart(m)
                replies.append(decode(key.key, sock.recv_multipart()[1:]).header)
                if attempt == 0:
                    s.discard(4)
                    assert released(s)
        finally:
            sock.close(0)
        assert replies[0]["op"] == "ack"
        assert replies[1]["op"] == "error" and replies[1]["code"] == Refusal.STALE_GRANT
        assert released(s) and not s._staged
        with DataClient(key, server.endpoint, timeout_s=30) as c:
            push_all(c, local(1), 5, pid(5))
        assert step(s, 5, ["a"], [100])


def test_replays_of_a_used_grant_are_stale():
    """Item 6: a base version ahead of the follower's, a layer sent twice (done or still
    streaming: a second stream could overwrite Δ after its norm was taken), the id of a push
    taken into a round: STALE_GRANT, and the round's step is the honest one bit for bit."""
    s = shard()
    assert _code(_stream, s, head("a", 1, "a", pid(1), base=1)) is Refusal.STALE_GRANT
    _stream(s, head("a", 1, "a", pid(1)), local(1))
    other = {n: t * 2 for n, t in local(1).items()}
    assert _code(_stream, s, head("a", 1, "a", pid(1)), other) is Refusal.STALE_GRANT
    assert _code(_single, s, head("a", 1, "a", pid(1)), other) is Refusal.STALE_GRANT
    pending = s.open_push(head("a", 1, "b", pid(1)), [TensorSpec.of(n, t) for n, t in
                                                       tensors("b", local(1))])
    assert _code(_stream, s, head("a", 1, "b", pid(1)), other) is Refusal.STALE_GRANT
    raw = tensor_bytes(local(1)["b.w"])
    pending.write(0, 0, raw)
    pending.commit()
    for layer in LAYERS:
        _stream(s, head("b", 1, layer, pid(2), 300), local(2))
    assert step(s, 1, ["a", "b"], [100, 300]) == _reference()
    # A push sent ahead, taken into round 2 by its scoring: its chunks again are a replay.
    for layer in LAYERS:
        _stream(s, head("a", stage=True, layer=layer, push_id=pid(3)), local(1))
    assert s.score(2, ["a"], [pid(3)])[0][1]
    assert _code(_stream, s, head("a", stage=True, layer="a", push_id=pid(3))) is Refusal.STALE_GRANT


def test_a_restarted_follower_still_refuses_rounds_it_applied(tmp_path):
    s = shard(tmp_path)
    _honest_round(s, rnd=3)
    lines = (tmp_path / "applied.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["round"] == 3
    again = shard(tmp_path)  # the same state directory, a new process
    assert _code(_stream, again, head("a", 3, "a", pid(1))) is Refusal.STALE_GRANT
    _stream(again, head("a", 4, "a", pid(4)))


@pytest.mark.parametrize("path", ["single", "stream"])
def test_fp32_where_the_run_sends_bf16_is_refused(path):
    """Item 7: the single-message path accepted FP32 where BF16 was expected."""
    s = shard()
    send = _single if path == "single" else _stream
    with pytest.raises(ValueError, match="dtype 'fp32', the run's wire dtype is 'bf16'"):
        send(s, head(), local(1, torch.float32))
    assert s._staged[(1, "a")].error  # the push is invalid on this shard: excluded everywhere


def test_tokens_are_the_tickets_not_the_headers():
    """T_j of the round's sum comes from the ticket: a header claiming 10^18 changes nothing."""
    s = shard()
    for c, seed, t in (("a", 1, 100), ("b", 2, 300)):
        for layer in LAYERS:
            h = head(c, 1, layer, pid(seed), t)
            h["tokens"] = 10**18  # the leader admitted T, whatever the header says
            _stream(s, h, local(seed))
    assert s._sums[1].tokens == {"a": 100, "b": 300}
    assert step(s, 1, ["a", "b"], [100, 300]) == _reference()


def test_a_follower_whose_data_plane_died_is_marked_down(tmp_path):
    """Item 1: heartbeats kept a follower whose consumer thread had died marked up; its
    registration now says the data plane stopped, and the leader marks it down."""
    from dips.roles.leader import FollowerEntry, Leader, LeaderConfig

    leader = Leader(LeaderConfig(followers=1), connect=lambda e: object(), run_dir=tmp_path)
    entry = FollowerEntry(0, "tcp://127.0.0.1:1", "", ["a", "b"], [1, 1], incarnation=7)
    leader.register_follower(entry)
    assert leader.followers[0].up
    broken = FollowerEntry(0, "tcp://127.0.0.1:1", "", ["a", "b"], [1, 1], incarnation=7,
                           data_plane_error="thread data-consumer died: TypeError: unhashable")
    for _ in range(3):
        answer = leader.register_follower(broken)
        assert answer.data_secret == leader.issued.data_secret
        assert not leader.followers[0].up and not leader.ready and leader.needs_reconcile
    events = [json.loads(line) for line in (tmp_path / "leader_events.jsonl").read_text().splitlines()]
    down = [e for e in events if e["event"] == "follower_down"]
    assert len(down) == 1 and down[0]["cause"] == "data plane" and "consumer" in down[0]["error"]
    leader.register_follower(FollowerEntry(0, "tcp://127.0.0.1:1", "", ["a", "b"], [1, 1],
                                           incarnation=8))  # restarted: serves again
    assert leader.followers[0].up


# ----- a push stream that sends BEGIN and then nothing (review of issue 13) ----------------
def test_a_silent_stream_holds_no_buffer_past_its_round():
    """A member sent BEGIN under a valid ticket, then nothing: its sink kept the push's
    whole-shard FP32 Δ until the stream went stale (120 s), and the pool allocated a fresh one
    for every round meanwhile. Now the buffer goes back when the round closes (applied,
    discarded or aborted), the sink refuses every later write STALE_GRANT, and so does a
    stream of a push sent ahead of its round once the cluster's newer push replaced it."""
    s = shard()
    specs = [TensorSpec.of(n, t) for n, t in tensors("a", local(9))]
    raw = tensor_bytes(local(9)["a.w"])
    for rnd, close in ((1, "apply"), (2, "discard"), (3, "abort")):
        silent = s.open_push(head("h", rnd, "a", pid(100 + rnd)), specs)
        silent.write(0, 0, raw[:1024])  # a start, then silence
        assert pool_live(s) == 1 and not silent.revoked
        if close == "apply":
            assert _honest_round(s, rnd) == _reference(rnd)  # θ as if it never came
        elif close == "discard":
            s.discard(rnd)
        else:
            s.abort(rnd)
        assert silent.revoked and pool_live(s) == 0
        assert _code(silent.write, 0, 1024, raw[1024:2048]) is Refusal.STALE_GRANT
        assert _code(silent.commit) is Refusal.STALE_GRANT
        silent.abort("the server drops it")  # harmless after the record is gone
    assert s._pools[0].allocated <= 3  # reused round after round, not one more per round
    # Sent ahead of its round: replaced by the cluster's newer push, the old stream stops.
    early = s.open_push(head("h", stage=True, layer="b", push_id=pid(200)),
                        [TensorSpec.of(n, t) for n, t in tensors("b", local(9))])
    _single(s, head("h", stage=True, layer="b", push_id=pid(201)), layer="b")
    assert early.revoked
    assert _code(early.write, 0, 0, tensor_bytes(local(9)["b.w"])[:1024]) is Refusal.STALE_GRANT


def test_silent_streams_on_a_real_server_are_refused_when_their_round_closes():
    """The same over the data plane, round after round: BEGIN under a valid ticket, then
    silence. When the round closes the follower's buffers are back in the pool (its live
    count is what the open rounds hold: none), and the stream is answered STALE_GRANT."""
    import zmq

    from dips.wire.frames import decode
    from dips.wire.stream import StreamWriter
    from tests.fuzz.hostile import wait_for

    s = shard()
    key = key_of("h")
    pairs = tensors("a", local(9))
    with served(s) as server, DataClient(key_of("a"), server.endpoint, timeout_s=30) as a, \
            DataClient(key_of("b"), server.endpoint, timeout_s=30) as b:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 60_000)
        sock.connect(server.endpoint)
        try:
            for rnd in range(1, 5):
                w = StreamWriter(key.key, head("h", rnd, "a", pid(100 + rnd)),
                                 [TensorSpec.of(n, t) for n, t in pairs], 1024)
                begin = w.begin()
                sock.send_multipart([begin[0], key.key_id.encode(), *begin[1:]])
                wait_for(lambda: (rnd, "h") in s._staged and s._staged[(rnd, "h")].open,
                         what="the silent stream admitted")
                push_all(a, local(1), rnd, pid(1 + 10 * rnd))
                push_all(b, local(2), rnd, pid(2 + 10 * rnd), "b", 300)
                checksum = step(s, rnd, ["a", "b"], [100, 300])
                if rnd == 1:
                    assert checksum == _reference()
                reply = decode(key.key, sock.recv_multipart()[1:]).header
                assert reply["op"] == "error" and reply["code"] == Refusal.STALE_GRANT
                assert reply["xfer"] == w.xfer.hex()
                assert released(s) and server.pull_stats()["push_streams"] == 0
        finally:
            sock.close(0)
        assert s._pools[0].allocated <= 4 and server.healthy()
