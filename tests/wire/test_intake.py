"""The pieces of the data server's gate (review 21, F1): per-connection queues bounded in
messages and bytes and served round-robin, whole-message limits derived from the shard,
refusals counted and logged at most once per interval, and key ids found by look-up only."""

from __future__ import annotations

import logging

import pytest

from dips.wire.intake import ENVELOPE_BYTES, FairQueue, MessageLimits, shard_limits
from dips.wire.keys import FRESH_KEYS, Keyring, issue
from dips.wire.pki import Identity
from dips.wire.refusals import Refusals
from dips.wire.stream import MAX_CHUNK_BYTES

SECRET = b"s" * 32
pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_connections_are_served_in_turn_whatever_their_backlog():
    q = FairQueue(max_messages=100, max_bytes=10_000, total_bytes=100_000)
    for k in range(50):
        assert q.put("flood", ("f", k), 10) is None
    assert q.put("honest", ("h", 0), 10) is None
    order = [q.get(0)[0] for _ in range(4)]
    assert order == ["flood", "honest", "flood", "flood"]  # one turn each, not FIFO
    assert len(q) == 47 and q.queued("flood") == (47, 470)


def test_a_connection_is_refused_beyond_its_messages_or_bytes_at_once():
    q = FairQueue(max_messages=3, max_bytes=100, total_bytes=10_000)
    assert [q.put("a", k, 10) for k in range(4)] == [None, None, None, "queue_full"]
    assert q.put("b", "big", 500) is None  # alone, one message larger than max_bytes is taken
    assert q.put("b", "more", 1) == "queue_full"
    assert q.put("c", "x", 60) is None and q.put("c", "y", 50) == "queue_full"
    assert q.refused == 3 and q.queued("a") == (3, 30)


def test_forced_items_are_never_refused_and_count_towards_no_bound():
    q = FairQueue(max_messages=1, max_bytes=10, total_bytes=10)
    assert q.put("a", "m", 10) is None
    assert all(q.put("a", k, 4 << 20, force=True) is None for k in range(8))
    assert q.queued("a") == (1, 10) and q.queued_bytes() == 10 and len(q) == 9
    assert [q.get(0)[1] for _ in range(9)] == ["m", *range(8)]  # one connection: FIFO


def test_beyond_the_total_the_fullest_connection_makes_room():
    dropped = []
    q = FairQueue(max_messages=100, max_bytes=1000, total_bytes=1000, on_drop=dropped.append)
    for k in range(10):
        assert q.put("flood", k, 100) is None
    assert q.put("honest", "h", 100) is None  # the flood's newest message goes
    assert dropped == [9] and q.evicted == 1 and q.queued("flood") == (9, 900)
    assert q.put("flood", 10, 100) == "queue_full"  # the fullest itself is refused
    assert q.queued_bytes() == 1000 and q.queued("honest") == (1, 100)


def test_the_wait_is_the_longest_any_connection_waits_for_its_turn():
    clock = Clock()
    q = FairQueue(max_messages=100, max_bytes=10_000, total_bytes=100_000, clock=clock)
    assert q.wait_s() == 0.0
    for k in range(10):
        q.put("flood", k, 10)
    clock.t += 5
    q.put("honest", "h", 10)
    clock.t += 1
    assert q.wait_s() == 6.0  # the flood's head has waited since it was queued
    q.get(0)
    assert q.wait_s() == 1.0  # the flood's next item waits from its last turn; honest 1 s
    q.get(0)
    clock.t += 2
    assert q.wait_s() == 2.0 and q.connections() == 1  # the flood alone, since its turn


def test_message_limits_follow_the_kind_and_the_shard():
    shapes = {"a.w": (40, 30), "a.b": (30,), "b.w": (30, 20)}
    limits = shard_limits(shapes, {"a": ["a.w", "a.b"], "b": ["b.w"]}, 8 << 20)
    assert limits.single_frames == 2
    assert limits.single_bytes == limits.header_bytes + (40 * 30 + 30) * 4 + 2 * 16
    assert limits.header_bytes < 16 << 10
    assert limits.check(b"M", 3 + 2, 100) is None
    assert limits.check(b"M", 3 + 3, 100) == "too_many_frames"
    assert limits.check(b"M", 5, limits.single_bytes + ENVELOPE_BYTES + 1) == "too_large"
    assert limits.check(b"R", 4, 10) == "too_many_frames"
    assert limits.check(b"B", 3, limits.header_bytes + ENVELOPE_BYTES + 1) == "too_large"
    assert limits.check(b"C", 3, MAX_CHUNK_BYTES + 16 + 64) is None
    assert limits.check(b"C", 4, 100) == "too_many_frames"
    assert limits.check(b"E", 2, ENVELOPE_BYTES + 1) == "too_large"
    assert MessageLimits().check(b"M", 1000, 1 << 20) is None  # a server without a shard


def test_refusals_are_counted_by_reason_and_logged_once_per_interval(caplog):
    caplog.set_level(logging.WARNING, logger="dips.wire.dataplane")
    clock = Clock()
    r = Refusals(interval_s=10.0, clock=clock)
    for _ in range(1000):
        r("unknown_key")
    r("too_large", "a \x1b[2J message")
    assert r.counts() == {"unknown_key": 1000, "too_large": 1} and r.lines == 1
    clock.t += 10
    r.flush()
    assert r.lines == 2
    lines = [rec.getMessage() for rec in caplog.records]
    assert len(lines) == 2 and "unknown_key 1" in lines[0]
    assert "too_large 1, unknown_key 999" in lines[1] and "\x1b" not in lines[1]
    r.flush(force=True)
    assert r.lines == 2  # nothing new to say


def test_a_key_id_is_found_by_look_up_and_an_unissued_one_costs_no_derivation():
    ring = Keyring(SECRET)
    a, b = (issue(SECRET, Identity.cluster(c), False, seq) for c, seq in (("a", 3), ("b", 7)))
    ring.set_members([a.key_id, b.key_id], next_seq=8)
    misses = ring._lookup.cache_info().misses
    assert ring.lookup(a.key_id.encode()) == (a, "")
    stranger = b"cluster-zz/" + b"0" * 32  # well formed; nobody was issued it (seq 0)
    assert ring.lookup(stranger) == (None, "unknown_key")
    far = issue(SECRET, Identity.cluster("c"), False, 8 + FRESH_KEYS).key_id.encode()
    assert ring.lookup(far) == (None, "unknown_key")  # beyond the ids issued since the list
    assert ring.lookup(b"not-a-key") == (None, "key_id")
    assert ring.lookup(b"\xff" * 40) == (None, "key_id")
    assert ring._lookup.cache_info().misses == misses  # nothing derived for any of them
    fresh = issue(SECRET, Identity.cluster("c"), False, 9)  # joined since the last list
    assert ring.lookup(fresh.key_id.encode()) == (fresh, "")
    ring.set_members([b.key_id, fresh.key_id], next_seq=10)  # a left
    assert ring.lookup(a.key_id.encode()) == (a, "")  # retired: still told NOT_JOINED
    assert not ring.current(a.key_id) and ring.current(fresh.key_id)
    assert Keyring(None).lookup(a.key_id.encode()) == (None, "no_secret")
