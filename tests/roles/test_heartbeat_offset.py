"""Heartbeats start at a random offset within the interval (issue 16: members that start
together beat in the same second for ever; the §16 run's leader got all 25 members' beats in
one second every 27 s). The cluster's heartbeat thread is driven on a clock the test moves
(its waits return at once, advancing it); the leader's monitor is ticked by hand."""

from __future__ import annotations

import threading
import types

import pytest

from dips.algo.ratelimit import first_beat_delay
from dips.roles import client_hold
from dips.roles.client_hold import HeartbeatMixin
from tests.roles.test_hostile_join import PERIOD, RUN, Clock, leader_on

pytestmark = pytest.mark.timeout(60)


class Moved:
    """A stop event whose wait returns at once, moving ``clock`` by the wait; it reports
    "stopped" after ``waits`` waits."""

    def __init__(self, clock: list[float], waits: int) -> None:
        self.clock, self.left, self.waits = clock, waits, []

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        self.left -= 1
        if self.left < 0:
            return True
        self.clock[0] += timeout
        return False

    def set(self) -> None:
        self.left = -1


class Beating(HeartbeatMixin):
    """The heartbeat thread of a cluster client, with a leader that records each beat."""

    def __init__(self, clock: list[float], interval_s: float) -> None:
        self.cluster_id, self.inner_step, self.tokens_total, self.last_loss = "a", 0, 0, 0.0
        self.finished, self.leader_version, self._followers_epoch = "", -1, None
        self._hb_interval, self._hb_thread = interval_s, None
        self._rejoin, self._retry_at, self._backoff_s = threading.Event(), 0.0, 0.5
        self.beats: list[float] = []
        reply = types.SimpleNamespace(followers_epoch=0, version=0, finished="", known=True)
        self._leader = types.SimpleNamespace(
            Heartbeat=lambda req, timeout: self.beats.append(clock[0]) or reply)

    def run(self, stop: Moved, u: float) -> None:
        """Start the thread with offset draw ``u``; wait until it stopped."""
        self._hb_stop, self.beat_offset = stop, lambda: u
        self._start_heartbeat()
        self._hb_thread.join(10)
        assert not self._hb_thread.is_alive()
        self._hb_thread = None


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(client_hold, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_the_first_beat_comes_at_the_drawn_offset_then_every_interval(clock):
    c = Beating(clock, interval_s=2.0)
    stop = Moved(clock, waits=3)
    c.run(stop, u=0.25)
    assert stop.waits == [0.5, 2.0, 2.0, 2.0]  # (the old thread waited 2.0 first)
    assert c.beats == [100.5, 102.5, 104.5]


def test_a_thread_started_again_in_one_process_beats_no_sooner_than_an_interval(clock):
    c = Beating(clock, interval_s=2.0)
    c.run(Moved(clock, waits=3), u=0.25)  # beats at 100.5, 102.5, 104.5; stopped at 104.5
    clock[0] = 105.0  # a failed join stopped it, the next join starts it 0.5 s after a beat
    again = Moved(clock, waits=1)
    c.run(again, u=0.1)
    assert again.waits[0] == pytest.approx(1.5) and c.beats[-1] == pytest.approx(106.5)
    clock[0] = 200.0  # long after: the drawn offset alone
    later = Moved(clock, waits=1)
    c.run(later, u=0.1)
    assert later.waits[0] == pytest.approx(0.2) and c.beats[-1] == pytest.approx(200.2)


def test_members_started_together_beat_in_different_seconds():
    draws = [k / 25 for k in range(25)]  # 25 members, offsets spread as uniform draws are
    seconds = {int(1000.0 + first_beat_delay(27.0, u)) for u in draws}
    assert len(seconds) == 25  # (from their join they beat in one second: 1027)


def test_the_latest_first_beat_leaves_two_intervals_of_slack(tmp_path):
    """§12: removed after 3 missed intervals. Joined at 1000, the latest first beat (u → 1)
    comes before 1001; the leader would remove the cluster only after 1003 without it."""
    clock = Clock()
    leader = leader_on(clock, tmp_path)  # heartbeat interval 1 s, 3 missed
    leader.join_cluster("a", [["l0", "l1"]], RUN)
    joined = clock.t
    latest = joined + first_beat_delay(1.0, 1.0 - 2 ** -20)
    removed_at = None
    for k in range(1, 40):  # the cluster's first beat never comes
        clock.t = joined + k * PERIOD
        for i in (0, 1):
            leader.followers[i].last_seen = clock.t  # the followers beat on
        if leader._watch(PERIOD):
            removed_at = clock.t
            break
    assert removed_at == joined + 13 * PERIOD  # silent 3.25 s > 3 intervals
    assert removed_at - latest >= 2.0  # two intervals of slack after the latest first beat
    leader.join_cluster("a", [["l0", "l1"]], RUN)
    joined = clock.t  # now it beats: first at the latest offset, then every interval
    due = [joined + first_beat_delay(1.0, 1.0 - 2 ** -20) + k for k in range(15)]
    for k in range(1, 60):
        clock.t = joined + k * PERIOD
        while due and due[0] <= clock.t:
            leader.heartbeat("a", k, k, None)
            due.pop(0)
        for i in (0, 1):
            leader.followers[i].last_seen = clock.t
        assert leader._watch(PERIOD) == []
    assert "a" in leader.clusters

