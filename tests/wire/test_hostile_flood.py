"""Review 21, F1: a stranger (no key) or a member floods a follower's data plane.

The review's inputs, at a test's scale, against a real follower shard behind a real data
server (127.0.0.1, a random port), whose keyring holds the run's member list as a registered
follower's does: A1, one message of many frames each under ``ZMQ_MAXMSGSIZE``; A2, many such
messages under a key id nobody was issued; A3, header-only messages (``M``, ``R``, and of an
unknown kind) as fast as a socket sends them; and a member whose backlog fills its queue.
Each asserts bounds (queue sizes, what was kept, what was sent back, log lines, counts), that
an honest push and pull complete, and that no serving thread stopped.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager

import pytest
import torch
import zmq

from dips.algo.refusal import Refusal, Refused
from dips.roles.cluster import StageWorker
from dips.wire.dataclient import MSG, PULL, DataClient, DataPlaneError
from dips.wire.dataplane import DataServer
from dips.wire.frames import encode
from dips.wire.gate import INQ_MESSAGES, PULLQ_MESSAGES
from dips.wire.keys import Keyring, issue
from dips.wire.pki import Identity
from tests.fuzz.hostile import (
    SECRET,
    head,
    local,
    pid,
    push_all,
    shard,
    tensors,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)
STRANGER = b"cluster-zz/" + b"0" * 32  # well formed; nobody was issued it (the review's)
FRAME = bytes(64 << 10)  # each frame far under the follower's ZMQ_MAXMSGSIZE


#: The members' keys, issued as the leader's sequence numbers 1, 2 and 3.
KEYS = {c: issue(SECRET, Identity.cluster(c), False, seq) for seq, c in enumerate("abh", 1)}


def _ring() -> Keyring:
    """A registered follower's keyring: members a, b and h, the next key id 4."""
    ring = Keyring(SECRET)
    ring.set_members([k.key_id for k in KEYS.values()], next_seq=4)
    return ring


@contextmanager
def _served(s, handler=None, streams=None, **kw):
    server = DataServer(_ring(), handler or s.handle, streams=streams or s,
                        authorize=s.authorize, **kw).start()
    try:
        yield server
    finally:
        server.stop()


def _dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    return sock


def _honest(s, server) -> None:
    """An honest push (streamed, and as single messages) and pull, answered in full."""
    with DataClient(KEYS["a"], server.endpoint, timeout_s=30) as c:
        push_all(c, local(1), 1, pid(1))
        out = [(n, torch.empty(t.shape, dtype=torch.bfloat16)) for n, t in tensors("b", s.params)]
        assert c.pull({"op": "pull", "version": 0, "layers": ["b"]}, out)["version"] == 0
        assert torch.equal(out[0][1], s.params["b.w"].to(torch.bfloat16))
    with DataClient(KEYS["b"], server.endpoint, timeout_s=30) as b:
        push_all(b, local(2), 1, pid(2), "b", 300, single=True)
    assert s.score(1, ["a", "b"])[0][1] and server.healthy()


def test_a1_one_message_of_many_frames_is_dropped_whole_before_any_queue():
    """A1: 128 frames of 4 MiB - 64 B each passed libzmq's per-frame limit and the follower
    held +512 MB for one message. The whole message is now measured at the io thread: the
    review's input (a malformed key id) and the same under a key id nobody holds are
    dropped unanswered; under a member's key id it is refused INVALID_ARGUMENT by its size."""
    s = shard()
    with _served(s) as server:
        sock = _dealer(server.endpoint)
        try:
            sent = server.bytes_sent
            sock.send_multipart([MSG, b"not-a-key", b"{}", b"mac"] + [FRAME] * 128)
            sock.send_multipart([MSG, STRANGER, b"{}", b"mac"] + [FRAME] * 128)
            wait_for(lambda: server.refusals.total("key_id") == 1
                     and server.refusals.total("unknown_key") == 1, what="both dropped")
            assert server.bytes_sent == sent  # no reply to either
            h = KEYS["h"]
            frames = encode(h.key, {"op": "push", **head("h", 1, "a", pid(5))})
            sock.send_multipart([MSG, h.key_id.encode(), *frames] + [FRAME] * 128)
            reply = DataClient(h, server.endpoint)._check_error  # decodes an error reply
            with pytest.raises(DataPlaneError) as info:
                reply(sock.recv_multipart())
            assert info.value.code is Refusal.INVALID_ARGUMENT
            assert "carries at most" in str(info.value)
            assert server.refusals.total("too_many_frames") == 1
            stats = server.pull_stats()
            assert stats["inq_messages"] == stats["inq_bytes"] == 0 and not s._staged
        finally:
            sock.close(0)
        _honest(s, server)


def test_a2_a_flood_under_an_unissued_key_id_costs_no_mac_no_key_and_no_queue(caplog):
    """A2: 64 MiB messages under ``cluster-zz/0...0`` were queued without a bound (4.5 GB of
    follower RSS in 46 s) and each was HMACed whole before its refusal. Now each is dropped
    at the io thread after a dictionary look-up: no key is derived, nothing is queued, no
    reply is sent, one log line is written, and the drops are counted by reason."""
    caplog.set_level(logging.WARNING, logger="dips.wire.dataplane")
    s = shard()
    with _served(s) as server:
        server.refusals.interval_s = 3600.0  # one line for the whole test
        misses = server._keys._lookup.cache_info().misses
        sent = server.bytes_sent
        sock = _dealer(server.endpoint)
        try:
            n = 200
            for _ in range(n):
                sock.send_multipart([MSG, STRANGER, b'{"v":1,"op":"pull"}', b"m" * 32]
                                    + [FRAME] * 16, copy=False)
            wait_for(lambda: server.refusals.total("unknown_key") == n, what="every one dropped")
            _honest(s, server)  # the flood's connection is still open
        finally:
            sock.close(0)
        assert server._keys._lookup.cache_info().misses == misses  # no key derived
        assert server._inq.refused == server._inq.evicted == 0  # none reached a queue
        assert server.bytes_sent - sent < 1 << 20  # the honest replies only
        assert server.refusals.counts() == {"unknown_key": n}
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1


@pytest.mark.parametrize("kind", [MSG, PULL, b"X"])
def test_a3_header_only_floods_are_counted_and_write_one_log_line(kind, caplog):
    """A3: 4-frame header-only messages (``M``; ``R``, which stalled the pull producer) under
    an unissued key id, and 1-frame messages of an unknown kind: each wrote a WARNING (2.8 to
    3.7 MB/s of log) and queued work for a worker (honest steps 0.23-0.33x). Now: counted,
    one log line in all, nothing queued, and honest pushes and pulls go on."""
    caplog.set_level(logging.DEBUG, logger="dips.wire.dataplane")
    s = shard()
    msg = [b"X"] if kind == b"X" else [kind, STRANGER, b'{"v":1,"op":"pull"}', b"m" * 32]
    reason = "unknown_kind" if kind == b"X" else "unknown_key"
    with _served(s) as server:
        server.refusals.interval_s = 3600.0
        sock = _dealer(server.endpoint)
        try:
            n = 5000
            for _ in range(n):
                sock.send_multipart(msg)
            _honest(s, server)
            wait_for(lambda: server.refusals.total(reason) == n, what="every one counted")
        finally:
            sock.close(0)
        assert len(server._inq) == len(server._pullq) == 0
        assert server._pullq.refused == server._inq.refused == 0
    mine = [r for r in caplog.records if r.name == "dips.wire.dataplane"]
    lines = [r for r in mine if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and f"{reason} " in lines[0].getMessage()
    assert len(mine) <= 2  # and nothing below WARNING per message either


class _Hold:
    """A shard behind a data server whose first request of member ``h`` (an op ``slow``
    single message, or a pull) holds its worker until ``release`` is set; records how much
    was queued when each honest request was served."""

    def __init__(self, s) -> None:
        self.s, self.release, self.held = s, threading.Event(), threading.Event()
        self.server: DataServer | None = None
        self.queued_at_honest: list[tuple[int, int]] = []

    def _note(self) -> None:
        self.queued_at_honest.append((len(self.server._inq), len(self.server._pullq)))

    def handle(self, msg):
        if msg.header.get("op") == "slow":
            if not self.held.is_set():
                self.held.set()
                assert self.release.wait(60)
            raise Refused(Refusal.BUSY, "slow: refused")  # a typed refusal, answered
        self._note()
        return self.s.handle(msg)

    def open_push(self, header, specs):
        self._note()
        return self.s.open_push(header, specs)

    def open_pull(self, header):
        if header.get("hold") and not self.held.is_set():
            self.held.set()
            assert self.release.wait(60)
        else:
            self._note()
        return self.s.open_pull({k: v for k, v in header.items() if k != "hold"})

    def __getattr__(self, name):
        return getattr(self.s, name)


def test_a_members_backlog_does_not_hold_up_another_members_push_or_pull():
    """A member (valid key) keeps the consumer busy and its connection's queue full: its
    messages beyond INQ_MESSAGES are refused at once (``queue_full``), and an honest push,
    single message and pull are each served on their connection's next turn, ahead of the
    backlog (FIFO served them after it: the review's pushes waited 7.7 s). The same for pull
    requests at the producer, beyond PULLQ_MESSAGES."""
    s = shard()
    hold = _Hold(s)
    h = KEYS["h"]
    with _served(s, hold.handle, hold) as server:
        hold.server = server
        sock = _dealer(server.endpoint)
        try:
            flood = [MSG, h.key_id.encode(), *encode(h.key, {"op": "slow"})]
            for _ in range(1 + INQ_MESSAGES + 50):
                sock.send_multipart(flood)
            wait_for(lambda: hold.held.is_set() and server.refusals.total("queue_full")
                     + len(server._inq) == INQ_MESSAGES + 50, what="the member's queue full")
            assert INQ_MESSAGES - 1 <= len(server._inq) <= INQ_MESSAGES
            assert server._inq.queued_bytes() <= INQ_MESSAGES * 512
            done = threading.Event()

            def honest() -> None:
                with DataClient(KEYS["a"], server.endpoint, timeout_s=60) as c:
                    push_all(c, local(1), 1, pid(1))
                    push_all(c, local(1), 2, pid(3), single=True)
                done.set()

            t = threading.Thread(target=honest, daemon=True)
            t.start()
            wait_for(lambda: server._inq.connections() == 2, what="the honest BEGIN queued")
            hold.release.set()
            t.join(60)
            assert done.is_set()
            # The honest push was served on its connection's first turn, after at most one
            # more of the backlog (in FIFO order, after all of it).
            assert hold.queued_at_honest[0][0] >= INQ_MESSAGES - 2
            wait_for(lambda: len(server._inq) == 0, what="the backlog answered")
            # Pull requests: the producer held by one of h's, its connection's queue full.
            hold.held.clear()
            hold.release.clear()
            hold.queued_at_honest.clear()
            full = server.refusals.total("queue_full")
            for _ in range(1 + PULLQ_MESSAGES + 20):
                req = {"op": "pull", "version": 0, "layers": ["b"], "hold": True,
                       "xfer": "ab" * 16, "chunk": 1024}
                sock.send_multipart([PULL, h.key_id.encode(), *encode(h.key, req)])
            wait_for(lambda: hold.held.is_set() and server.refusals.total("queue_full") - full
                     + len(server._pullq) == PULLQ_MESSAGES + 20,
                     what="the member's pull queue full")
            assert PULLQ_MESSAGES - 1 <= len(server._pullq) <= PULLQ_MESSAGES
            out = [(n, torch.empty(t.shape, dtype=torch.bfloat16)) for n, t in tensors("b", s.params)]
            got = {}

            def pull() -> None:
                with DataClient(KEYS["b"], server.endpoint, timeout_s=60) as b:
                    got["v"] = b.pull({"op": "pull", "version": 0, "layers": ["b"]}, out)

            t = threading.Thread(target=pull, daemon=True)
            t.start()
            wait_for(lambda: server._pullq.connections() == 2, what="the honest pull queued")
            hold.release.set()
            t.join(60)
            assert got["v"]["version"] == 0
            assert hold.queued_at_honest[0][1] >= PULLQ_MESSAGES - 3
        finally:
            sock.close(0)
        assert server.healthy()


def test_a_single_message_pull_is_capped_and_a_larger_read_is_streamed(monkeypatch):
    """Review 21: a single-message pull's reply was the whole shard, built on the consumer
    under the shard lock (a 148-byte request: +28 MB and 0.6 s of the consumer on a 38 MB
    shard). A reply over SINGLE_REPLY_BYTES is now refused before it is built (scaled down
    here to 2,000 bytes: layer ``a`` is 2,460 bytes in BF16), holding nothing; a stage
    worker in single mode pulls it as a stream."""
    import dips.roles.cluster
    import dips.roles.follower_data

    monkeypatch.setattr(dips.roles.follower_data, "SINGLE_REPLY_BYTES", 2000)
    monkeypatch.setattr(dips.roles.cluster, "SINGLE_REPLY_BYTES", 2000)
    s = shard()
    with _served(s) as server:
        with DataClient(KEYS["a"], server.endpoint, timeout_s=30) as c:
            with pytest.raises(DataPlaneError) as info:
                c.request({"op": "pull", "version": 0, "layers": ["a"]})
            assert info.value.code is Refusal.INVALID_ARGUMENT
            assert "'layers'" in str(info.value) and "stream" in str(info.value)
            assert server.pulls.held() == 0
            small = c.request({"op": "pull", "version": 0, "layers": ["b"]})  # 1,200 bytes
            assert torch.equal(small.tensors["b.w"], s.params["b.w"].to(torch.bfloat16))
        params = {n: torch.nn.Parameter(torch.zeros(t.shape)) for n, t in s.params.items()}
        layers = {"a": [(n, params[n]) for n in ("a.w", "a.b")]}
        worker = StageWorker(0, layers, KEYS["a"], {0: server.endpoint}, timeout_s=30)
        worker.mode = "single"
        try:
            got = worker.pull(0, {"a": 0})
            assert torch.equal(got["a.w"], s.params["a.w"].to(torch.bfloat16))
        finally:
            for client in worker._clients.values():
                client.close()
        assert server.refusals.total("invalid_argument") == 1 and server.healthy()
