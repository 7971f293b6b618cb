"""The evaluator's loop (issue 15, :class:`dips.node.evaluate.Evaluator`) against a real leader
behind a real gRPC server on 127.0.0.1 (insecure identities), with the model pull replaced by
a stand-in whose outcome the test chooses (the end-to-end test pulls from real followers):
a failed pull backs off and then takes the newest version, a leader that stops answering is
found again after its restart on the same address, a report it could not take is sent again,
a refused report is not retried, and a restarted evaluator goes on after the leader's last
record. Time is the test's: ``step(now)`` is given the clock."""

from __future__ import annotations

import time

import pytest

from dips.algo.evaluation import Schedule
from dips.emu.launcher import free_port
from dips.node.evaluate import POLL_S, Evaluator
from dips.roles.leader import Leader
from dips.wire.pki import Identity
from dips.wire.security import Credentials
from dips.wire.services import leader_client
from tests.roles.test_hostile_leader import Site

pytestmark = pytest.mark.timeout(120)


class Pull:
    """The stand-in of :class:`dips.emu.summary.HeldOut`: each call takes the next outcome
    (a loss, or an error text) and records the version it was asked for."""

    eval_tokens = 4096

    def __init__(self, *outcomes: float | str) -> None:
        self.outcomes = list(outcomes)
        self.asked: list[int] = []

    def pull_and_evaluate(self, source, key, attempts=1):
        followers, version = source()
        assert followers and key.key_id.startswith("admin/")
        self.asked.append(version)
        out = self.outcomes.pop(0)
        return (None, None, out) if isinstance(out, str) else (out, version, None)


def step(site: Site) -> int:
    """One outer step: cluster a's push alone (the window closes on the test's clock)."""
    leader = site.leader
    leader.join_cluster("a", [["l0", "l1"]])
    grant = leader.request_push("a", leader.version, 64, 5.0)
    site.clock.advance(5.0)
    assert leader.push_done("a", grant.push_id, True, "", 30.0).verdict.accepted
    leader.pull_done("a", leader.version)
    return leader.version


class Harness:
    """A leader served on a fixed free port (so a restart keeps its address) and the
    evaluators of a test; :meth:`close` stops all."""

    def __init__(self, tmp_path) -> None:
        self.tmp_path, self.port = tmp_path, free_port()
        self.site = Site(tmp_path, port=self.port)
        self.evaluators: list[Evaluator] = []

    def restart(self) -> Site:
        """Stop the leader and start another from its state directory, on the same port."""
        self.site.close()
        self.site = Site(self.tmp_path, port=self.port)
        return self.site

    def evaluator(self, pull: Pull, every: int = 1) -> Evaluator:
        client = leader_client(f"127.0.0.1:{self.port}", Credentials.insecure(Identity.admin()),
                               timeout_s=5.0)
        ev = Evaluator(client, pull, Schedule(every), rpc_s=5.0, leader=f"127.0.0.1:{self.port}")
        self.evaluators.append(ev)
        return ev

    def close(self) -> None:
        for ev in self.evaluators:
            ev.client.close()
        self.site.close()


@pytest.fixture
def h(tmp_path):
    harness = Harness(tmp_path)
    yield harness
    harness.close()


def versions(leader: Leader) -> int | None:
    rec = leader.last_eval()
    return None if rec is None else rec["version"]


def test_a_failed_pull_backs_off_then_takes_the_newest_version(h):
    site = h.site
    pull = Pull(6.0, "TimeoutError: follower 1 did not answer", 5.0)
    ev = h.evaluator(pull, every=2)
    assert ev.step(now=0.0) == 0.0 and versions(site.leader) == 0
    assert ev.step(now=0.1) == POLL_S  # version 0 again: nothing due
    step(site), step(site)
    site.leader.followers[0].up = False  # a follower down: no pull that would wait on it
    assert ev.step(now=0.5) == POLL_S and pull.asked == [0]
    site.leader.followers[0].up = True
    assert ev.step(now=1.0) == 0.5  # version 2 due; its pull failed: back off
    assert ev.key is None and ev.counts["failed"] == 1
    assert ev.step(now=1.2) == POLL_S  # still backing off
    step(site)
    assert ev.step(now=1.5) == 0.0  # the newest version, 3, not the failed 2
    assert pull.asked == [0, 2, 3] and versions(site.leader) == 3
    assert (ev.schedule.failures, ev.counts["reported"]) == (0, 2)


def test_a_restarted_leader_is_found_again_and_gets_the_report_it_missed(h):
    def pull_then_leader_stops(source, key, attempts=1):
        _, version = source()
        h.site.server.stop(0).wait(5)  # the leader goes away between the pull and the report
        return 5.5, version, None

    ev = h.evaluator(Pull(6.0))
    assert ev.step(now=0.0) == 0.0 and versions(h.site.leader) == 0
    step(h.site)
    ev.held.pull_and_evaluate = pull_then_leader_stops
    assert ev.step(now=1.0) == 0.5  # the report of version 1 failed: kept, sent again
    assert ev.pending is not None and ev.pending.version == 1
    assert ev.step(now=2.0) == 1.0 and ev.key is None  # no answer at all now
    site = h.restart()  # resumed from its state directory
    assert versions(site.leader) == 0  # its series goes on from eval.jsonl
    while site.leader.version < 1:  # (its fresh stand-in follower rolled it back to 0)
        step(site)
    deadline = time.monotonic() + 60.0  # the event: gRPC reconnects (about a second)
    while ev.pending is not None and time.monotonic() < deadline:
        time.sleep(min(ev.step(now=time.monotonic()), 0.1))  # as Evaluator.run waits
    assert ev.pending is None and versions(site.leader) == 1
    assert ev.counts["reported"] == 2


def test_a_refused_report_is_not_retried_and_a_restarted_evaluator_goes_on(h, tmp_path):
    site = h.site
    first = h.evaluator(Pull(6.0))
    again = h.evaluator(Pull(5.0))  # a new process: goes on after the leader's version 0
    stale = h.evaluator(Pull(6.0))  # one that does not ask what the leader has
    stale.resumed = True
    assert first.step(now=0.0) == 0.0 and versions(site.leader) == 0
    assert again.step(now=0.0) == POLL_S and again.schedule.last == 0
    step(site)
    assert again.step(now=1.0) == 0.0 and versions(site.leader) == 1
    assert stale.step(now=0.0) == 0.0 and stale.counts["refused"] == 1  # 1: repeated
    assert stale.pending is None and stale.schedule.last == 1  # refused for good
    assert stale.step(now=1.0) == POLL_S and stale.counts["refused"] == 1  # not sent again
    assert versions(site.leader) == 1
    assert len((tmp_path / "eval.jsonl").read_text().splitlines()) == 2
