"""Two checks of one fault-free `dips launch` (shared_run.py): the run is the expensive part
(most of a minute of process start-up and shut-down on 2 cores), the checks are cheap, so they
share one module and, under `make test`'s two workers, one worker.

- exactly once (issue 10), input 2: a slow link sends its push ahead of its round;
- SIGINT on `dips launch` and a second leader beside the live one (issue 11).
"""

from __future__ import annotations

import json

import pytest

from tests.integration import shared_run
from tests.integration.invariants import check_run, jsonl
from tests.integration.runner import jsonl_so_far
from tests.node.roles import alive

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def quiet_run(tmp_path_factory) -> shared_run.SharedRun:
    """The one fault-free run (a slow link) both tests check a property of: see shared_run.py."""
    return shared_run.run(tmp_path_factory.mktemp("quiet-run"))


def test_a_slow_link_sends_its_push_ahead_instead_of_stalling_every_round(quiet_run):
    """Input 2: cluster c uploads at 40 kbit/s (a push takes ~14 s against ~0.1 s for the
    others) and the round push timeout is 6 s (the shared run, see shared_run.py). Once c's link is known its pushes are sent ahead of any round and join one
    only when they have arrived: they are delivered and scored (no longer all lost), the rounds
    of a and b do not wait for them, and nothing is counted twice (the client waits for its
    verdict as long as the leader may take)."""
    run_dir = quiet_run.run_dir
    check_run(run_dir)
    rounds = [r for r in jsonl(run_dir / "outer_steps.jsonl") if "event" not in r]
    ahead = [r for r in rounds if "c" in r.get("ahead", []) and "c" in r["scored"]]
    assert len(ahead) >= 2, "fewer than 2 pushes of c delivered ahead of their round"
    first_ahead = min(i for i, r in enumerate(rounds) if "c" in r.get("ahead", []))
    # From then on c never holds a round: every later push of c arrives ahead of its round.
    later_c = [r for r in rounds[first_ahead:] if "c" in r["clusters"]]
    assert all("c" in r["ahead"] for r in later_c), later_c
    assert all(r["invalid"].get("c") != "push not delivered in time" for r in later_c)


def test_sigint_writes_summary_and_stops_children(quiet_run):
    """The shared fault-free run (shared_run.py): once an outer step was accepted, a copy of
    the live leader's state directory started as a second leader on another port took term +
    1, found the followers leased to the live leader, and exited with code 3 without having
    changed a follower; the live leader went on making outer steps; then SIGINT on `dips
    launch` stopped every process and still wrote the summary."""
    second = quiet_run.second_leader
    # The followers followed the live leader's term before the second one started.
    assert second["follower_starts"] == [second["live_starts"]] * len(second["terms_before"])
    assert second["returncode"] == 3, second["stderr"][-2000:]
    # Refused either way: its state is behind the followers', or they stay leased to the
    # live leader (when the copy is exactly as recent as they are).
    assert ("a stale copy must not lead" in second["stderr"]
            or "leased to another live leader" in second["stderr"]), second["stderr"][-2000:]
    assert second["copy_term"] == second["live_starts"] + 1
    assert second["terms_after"] == second["terms_before"]  # no follower took its term
    run_dir = quiet_run.run_dir
    events = jsonl_so_far(run_dir / "leader_events.jsonl")
    assert not [e for e in events if e.get("event") == "leader_stepped_down"]
    # The live leader went on making outer steps after the second one exited.
    steps = [r for r in jsonl_so_far(run_dir / "outer_steps.jsonl") if r.get("accepted")]
    assert len(steps) > second["steps_at_exit"]

    assert "interrupted" in quiet_run.output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True
    assert summary["outer_steps"] >= 1
    assert summary["eval_loss_final"] is not None
    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    pids = [e["pid"] for e in events if e["event"] == "start"]
    assert len(pids) == 6
    assert not [p for p in pids if alive(p)]
