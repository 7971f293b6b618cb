"""Review 21, F2: one member's malformed fingerprint in ``JoinCluster`` held the leader's GIL for
3.5 s per call, ahead of the join rate limit; the monitor then blamed every honest member for
the leader's own stall. In process: a leader whose loop and monitor threads are not started
(the test ticks the monitor itself, on a clock it moves: its scheduling clock too), its servicer called directly."""

from __future__ import annotations

import pytest

from dips.algo import liveness
from dips.algo.limits import JOIN_BURST
from dips.algo.refusal import Refusal
from dips.roles import leader_members
from dips.roles.leader import FollowerEntry, Leader, LeaderConfig
from dips.roles.leader_types import Issued
from dips.spec import MembershipConfig
from dips.spec.fingerprint import Fingerprint
from dips.wire.pb import control_pb2 as pb
from dips.wire.services import LeaderServicer
from tests.servicer_context import Aborted, FakeContext

pytestmark = pytest.mark.timeout(60)

RUN = Fingerprint(architecture={"model_type": "llama"}, vocab_sha256="ab" * 32,
                  tensors=[("l0.w", [4], "float32"), ("l1.w", [4], "float32")]).to_json()
REVIEW_INPUT = '{"tensors":[' + ",".join(["0"] * 500_000) + "]}"
STAGES = [pb.StageLayers(layers=["l0", "l1"])]
PERIOD = 0.25  # the monitor's tick (heartbeat interval 1 s: min(0.25, 1 / 2))


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def leader_on(clock: Clock, tmp_path) -> Leader:
    """A leader with the run's fingerprint and two registered followers, not started."""
    cfg = LeaderConfig(followers=2, membership=MembershipConfig(heartbeat_interval_s=1.0,
                                                                missed_heartbeats=3))
    leader = Leader(cfg, connect=lambda e: None, run_dir=tmp_path, clock=clock,
                    issued=Issued(term=1, fingerprint=RUN))
    leader._tick_clock = clock  # the monitor's thread "runs" on it too: a jump is a stall
    leader.register_follower(FollowerEntry(0, "tcp://127.0.0.1:1", "", ["l0"], [4]))
    leader.register_follower(FollowerEntry(1, "tcp://127.0.0.1:2", "", ["l1"], [4]))
    return leader


def refusal(call) -> Refusal | None:
    try:
        call()
    except Aborted as e:
        return e.refusal
    return None


@pytest.fixture
def parses(monkeypatch) -> list[int]:
    """The lengths of the fingerprints the leader compared (dips.spec.fingerprint.mismatch)."""
    seen: list[int] = []
    real = leader_members.mismatch
    monkeypatch.setattr(leader_members, "mismatch",
                        lambda want, got: seen.append(len(got)) or real(want, got))
    return seen


def test_the_reviews_fingerprint_is_refused_and_counted_before_the_parse(tmp_path, parses):
    clock = Clock()
    leader = leader_on(clock, tmp_path)
    servicer = LeaderServicer(leader, None)
    hostile = pb.JoinRequest(cluster_id="c", stages=STAGES, fingerprint=REVIEW_INPUT)
    codes = [refusal(lambda: servicer.JoinCluster(hostile, FakeContext("cluster-c")))
             for _ in range(50)]  # the clock stands: a flood, one call after the other
    allowed = JOIN_BURST + 1  # the first join, then the burst of re-joins
    assert codes == [Refusal.MODEL_MISMATCH] * allowed + [Refusal.BUSY] * (50 - allowed)
    assert parses == [len(REVIEW_INPUT)] * allowed  # the refused 45 were never compared
    assert "c" not in leader.clusters
    honest = pb.JoinRequest(cluster_id="a", stages=STAGES, fingerprint=RUN)
    assert servicer.JoinCluster(honest, FakeContext("cluster-a")).key_id  # its own limit
    assert "a" in leader.clusters


def test_a_late_monitor_tick_removes_no_member_and_marks_no_follower_down(tmp_path):
    clock = Clock()
    leader = leader_on(clock, tmp_path)
    leader.join_cluster("a", [["l0", "l1"]], RUN)
    assert leader._watch(PERIOD) == []  # the first tick
    clock.t += 3.7  # the leader did not run for 3.7 s (> 3 intervals): nobody was heard
    assert leader._watch(PERIOD) == []
    assert "a" in leader.clusters and all(f.up for f in leader.followers.values())
    assert leader._lag.stalls == ((1000.0 + PERIOD, 1003.7),)


def test_a_member_silent_while_the_leader_runs_is_still_removed(tmp_path):
    clock = Clock()
    leader = leader_on(clock, tmp_path)
    leader.join_cluster("a", [["l0", "l1"]], RUN)

    def tick(heard: bool) -> list:
        clock.t += PERIOD
        if heard:
            leader.heartbeat("a", 1, 1, None)
        for i in (0, 1):  # the followers' heartbeats go on
            leader.register_follower(FollowerEntry(i, f"tcp://127.0.0.1:{i + 1}", "",
                                                   [f"l{i}"], [4]))
        return leader._watch(PERIOD)

    leader._watch(PERIOD)
    clock.t += 3.7  # a stall of the leader, then a member heard for a while
    assert leader._watch(PERIOD) == [] and all(tick(heard=True) == [] for _ in range(4))
    last_heard = clock.t
    ticks = [tick(heard=False) for _ in range(14)]  # 3.5 s of the leader's running time
    removed = [i for i, events in enumerate(ticks) if events]
    assert removed == [12]  # silent 13 periods = 3.25 s > 3 missed intervals, not sooner
    (kind, extra), = ticks[12]
    assert kind == "cluster_removed" and extra["silent_s"] == pytest.approx(13 * PERIOD)
    assert clock.t - last_heard > 3.0 and "a" not in leader.clusters
    assert all(f.up for f in leader.followers.values())


def test_silence_counts_only_the_judges_running_time():
    def tick(lag, t, since=0.0):
        return liveness.ticked(lag, t, t, 0.25, since)

    lag, stall = tick(liveness.OwnLag(), 10.0)
    assert stall == 0.0  # the first tick
    lag, stall = tick(lag, 10.5)
    assert stall == 0.0 and lag.stalls == ()  # two periods late at most: on time
    lag, stall = tick(lag, 14.0)
    assert stall == pytest.approx(3.25) and lag.stalls == ((10.75, 14.0),)
    assert liveness.silent_s(9.0, 14.0, lag) == pytest.approx(5.0 - 3.25)
    assert liveness.silent_s(12.0, 14.0, lag) == 0.0  # heard inside the stall
    assert liveness.silent_s(14.5, 14.0, lag) == 0.0
    lag, _ = tick(lag, 14.25, since=14.1)  # nobody is older than the stall
    assert lag.stalls == ()
    for i in range(200):  # stalls are bounded
        lag, _ = tick(lag, 20.0 + 2 * i)
    assert len(lag.stalls) == liveness.MAX_STALLS


def test_a_jump_of_the_decision_clock_alone_is_no_stall():
    """A test's hand-moved clock (or one synchronised forward) is not the judge's own lag: only
    lateness on the clock its thread is scheduled by is."""
    lag, _ = liveness.ticked(liveness.OwnLag(), 5.0, 1000.0, 0.25, 0.0)
    lag, stall = liveness.ticked(lag, 5.25, 1061.0, 0.25, 0.0)
    assert stall == 0.0 and lag.stalls == ()
    assert liveness.silent_s(1000.0, 1061.0, lag) == 61.0
    lag, stall = liveness.ticked(lag, 9.0, 1065.0, 0.25, 0.0)  # 3.5 s late on its own clock
    assert stall == pytest.approx(3.5) and lag.stalls == ((1061.5, 1065.0),)
    lag, stall = liveness.ticked(lag, None, 2000.0, 0.25, 0.0)  # no scheduling clock
    assert stall == 0.0 and lag.stalls == ((1061.5, 1065.0),)


@pytest.mark.parametrize("silent, cpu, hung", [
    (2.9, 0.0, False),   # within the probe's bound
    (3.7, 0.0, True),    # stopped or deadlocked: no CPU
    (3.7, None, True),   # unknown: as before
    (3.7, 0.9, False),   # busy: the review's 3.7 s of parsing
    (29.0, 0.3, False),
    (31.0, 0.3, True),   # busy beyond 10 bounds: hung (a loop that never answers)
])
def test_the_launcher_kills_a_hung_leader_not_a_busy_one(silent, cpu, hung):
    assert liveness.leader_hung(silent, cpu, 3.0) is hung
