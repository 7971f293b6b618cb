"""Replay refusal survives a follower restart, for every kind of ticket (issue 13; review 14,
finding F4).

The reviewer's input: a hostile member sends a layer of a push sent ahead of its round
(ticket round 0), gets its verdict, and replays it: refused STALE_GRANT; after kill -9 of the
follower and a restart from its state directory the same replay was acknowledged and staged,
as was a replay of a push open at the crash. A push sent ahead is not covered by the round
watermark (``applied.jsonl``), and used push ids lived only in memory. Now the follower
records each admitted push id on disk before it stages or acknowledges the push
(:class:`dips.roles.follower_admit.PushIds`) and a restarted one refuses every id it finds.

A restart here is what a follower process does after kill -9 (:mod:`dips.node.follower`): a
new shard from the newest complete checkpoint and the same state directory, behind a new
data server; the old one is abandoned, never closed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dips.algo.refusal import Refusal
from dips.roles import durable
from dips.roles.checkpoint import complete_versions, load_checkpoint
from dips.roles.follower import FollowerShard
from dips.roles.follower_admit import PUSH_IDS_FILE, PushIds
from dips.wire.dataplane import DataClient, DataPlaneError
from dips.wire.frames import Message
from tests.fuzz.hostile import (
    ADMIT,
    LAYERS,
    head,
    key_of,
    local,
    pid,
    released,
    served,
    step,
    tensors,
    theta,
)

pytestmark = pytest.mark.timeout(120)


def _follower(state: Path) -> FollowerShard:
    """A follower process's shard over ``state`` (a first start, or a restart from its newest
    complete checkpoint), registered: it checks tickets under the run's admission key."""
    ckpt = state / "checkpoints"
    saved = complete_versions(ckpt)
    names = [n for ns in LAYERS.values() for n in ns]
    params, momenta, version = theta(), None, 0
    if saved:
        params, momenta, _ = load_checkpoint(ckpt, saved[-1], names)
        version = saved[-1]
    s = FollowerShard(0, LAYERS, params, log_dir=state, version=version, momenta=momenta,
                      ckpt_dir=ckpt, wire_dtype="bf16", require_tickets=True)
    s.set_admission_key(ADMIT)
    return s


def _send(server, h: dict, single: bool = True, cluster: str = "h") -> dict | Refusal:
    """One layer of a push through the real data server: the reply header, or the refusal."""
    with DataClient(key_of(cluster), server.endpoint, timeout_s=30) as c:
        pairs = tensors(h["layer"], local(9))
        try:
            if single:
                return c.request(h, pairs).header
            return c.push(h, pairs, chunk_bytes=1024)
        except DataPlaneError as exc:
            return exc.code


def _honest(s: FollowerShard, rnd: int, push_id: str) -> None:
    """Round ``rnd`` with one honest push of cluster a (a fresh grant), applied."""
    for layer in LAYERS:
        s.handle(Message(head("a", rnd, layer, push_id), dict(tensors(layer, local(1)))))
    step(s, rnd, ["a"], [100])


def _nothing_staged(s: FollowerShard) -> bool:
    return not s._early and not s._staged and released(s)


def test_a_replayed_push_sent_ahead_is_refused_after_a_restart(tmp_path):
    """The reviewer's input (F4, r02.out): one layer of a push sent ahead, its verdict (the
    round scored it "layers missing"), its replay refused; after the restart the same replay
    was acknowledged and staged."""
    s = _follower(tmp_path)
    _honest(s, 1, pid(1))
    sent = head("h", layer="a", push_id=pid(7), stage=True)
    with served(s) as server:
        assert _send(server, sent)["op"] == "ack"
        scored = s.score(2, ["h"], [pid(7)])  # the leader names it in round 2: its verdict
        assert not scored[0][1] and "layers missing" in scored[0][3]
        s.discard(2)
        assert _send(server, sent) is Refusal.STALE_GRANT
    again = _follower(tmp_path)
    with served(again) as server:
        assert _send(server, sent) is Refusal.STALE_GRANT
        assert _send(server, sent, single=False) is Refusal.STALE_GRANT
        assert _send(server, {**sent, "layer": "b"}) is Refusal.STALE_GRANT
        assert _nothing_staged(again)
        fresh = head("h", layer="a", push_id=pid(8), stage=True)  # a new grant is admitted
        assert _send(server, fresh)["op"] == "ack"


@pytest.mark.parametrize("kind", ["sent ahead", "round"])
def test_a_push_open_at_the_crash_is_refused_after_a_restart(tmp_path, kind):
    """A push with one layer delivered when the follower is killed, its round (2, above the
    watermark 1) never closed here: every layer of it is refused after the restart, the one
    sent and the one not yet sent (what was staged died with the process)."""
    s = _follower(tmp_path)
    _honest(s, 1, pid(1))
    stage = kind == "sent ahead"
    first = head("h", 2, "a", pid(7), stage=stage)
    with served(s) as server:
        assert _send(server, first, single=False)["op"] == "ack"
    again = _follower(tmp_path)
    assert again._admission.closed == 1
    with served(again) as server:
        for layer in LAYERS:
            for single in (True, False):
                h = head("h", 2, layer, pid(7), stage=stage)
                assert _send(server, h, single) is Refusal.STALE_GRANT, (layer, single)
        assert _nothing_staged(again)
    _honest(again, 2, pid(2))  # the follower keeps working: a fresh grant, an applied round
    assert again.version == 2


def test_a_push_id_is_fsynced_once_per_push_before_its_ack(tmp_path, monkeypatch):
    """The first layer of a push writes and fsyncs its id before the reply; the push's other
    layers cost nothing more (the cost is per push, not per layer)."""
    s = _follower(tmp_path)
    path = tmp_path / PUSH_IDS_FILE
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        real(fd)
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(durable.os, "fsync", fsync)
    with served(s) as server:
        assert _send(server, head("h", 1, "a", pid(7)))["op"] == "ack"
        assert synced.count(str(path)) == 1 and path.read_text() == f"{pid(7)}\n"
        assert _send(server, head("h", 1, "b", pid(7)))["op"] == "ack"
        assert synced.count(str(path)) == 1


def test_a_push_whose_id_cannot_be_recorded_is_not_staged(tmp_path, monkeypatch):
    """A disk that refuses the write: the push is refused (not acknowledged, nothing staged)
    and its id not held, so the same grant succeeds once the disk does; the file, which may
    hold a line the disk did not take, is rewritten whole then (one line, not two)."""
    s = _follower(tmp_path)

    def broken(fd: int) -> None:
        raise OSError(5, "I/O error")

    monkeypatch.setattr(durable.os, "fsync", broken)
    h = head("h", 1, "a", pid(7))
    with pytest.raises(OSError):
        s.handle(Message(h, dict(tensors("a", local(9)))))
    assert not s._staged
    monkeypatch.undo()
    assert s.handle(Message(h, dict(tensors("a", local(9)))))[0]["op"] == "ack"
    assert (tmp_path / PUSH_IDS_FILE).read_text() == f"{pid(7)}\n"


def test_without_a_key_nothing_is_recorded(tmp_path):
    """Trusted in-process callers (no admission key) send no tickets: nothing is written."""
    s = FollowerShard(0, LAYERS, theta(), log_dir=tmp_path)
    _honest(s, 1, pid(1))
    assert not (tmp_path / PUSH_IDS_FILE).exists()


def test_the_file_is_bounded_and_a_line_cut_by_a_crash_is_dropped(tmp_path):
    """At most ``2 * keep`` lines on disk, the newest ``keep`` ids held across a restart; a
    line cut by a crash (never acknowledged) is dropped at start, and the ids after it are
    whole lines."""
    path = tmp_path / PUSH_IDS_FILE
    ids = PushIds(path, keep=4)
    for n in range(1, 12):
        ids.add(pid(n))
        assert len(path.read_text().splitlines()) < 8
    with open(path, "a") as f:
        f.write(pid(99)[:5])  # killed in the middle of the line
    again = PushIds(path, keep=4)
    assert [n for n in range(1, 12) if again.earlier(pid(n))] == [8, 9, 10, 11]
    assert path.read_text() == "".join(f"{pid(n)}\n" for n in (8, 9, 10, 11))
    again.add(pid(12))
    assert not again.earlier(pid(12))
    third = PushIds(path, keep=4)
    assert [n for n in range(1, 13) if third.earlier(pid(n))] == [9, 10, 11, 12]
