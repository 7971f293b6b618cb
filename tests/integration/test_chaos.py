"""Randomized fault schedules in the spirit of Jepsen (issue 10): hypothesis draws plans of
kills and stops of the leader, the followers and the clusters, at random protocol phases
(idle, window, push, update, pull) and times, over a short run of configs/tiny.yaml; after
each run the invariants of invariants.py hold: accepted tokens = the ledger's windows × tokens
per window, updates accepted <= pushed, every applied version decided and logged, every
follower applying the same steps, no window trained twice or lost.

Not part of ``make test`` (marker ``chaos``): a plan drawn at random must not block a landing,
and the suite must stay under 15 minutes. ``make chaos`` tries ``DIPS_CHAOS_EXAMPLES`` = 20
plans, seeded by the date so that each day explores new ones. A failing plan is printed by hypothesis and can be
replayed with ``dips launch --faults``. Plans are not shrunk: each example is a real run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hypothesis import Phase, given, seed, settings
from hypothesis import strategies as st

from tests.integration.invariants import check_run, effective_history
from tests.integration.runner import ROOT, jsonl_so_far, launch_until

EXAMPLES = int(os.environ.get("DIPS_CHAOS_EXAMPLES", "1"))
pytestmark = [pytest.mark.integration, pytest.mark.chaos,
              pytest.mark.timeout(420 * EXAMPLES + 60)]
TARGETS = ["leader", "follower-0", "follower-1", "cluster-a", "cluster-b", "cluster-c"]
PHASES = ["idle", "window", "push", "update", "pull"]


def _fault() -> st.SearchStrategy[str]:
    target = st.sampled_from(TARGETS)
    at = st.floats(8.0, 20.0).map(lambda x: round(x, 1))
    phase_kill = st.builds(lambda t, p, a: f"{{phase: {p}, after_s: {a}, action: kill, target: {t}}}",
                           target, st.sampled_from(PHASES), at)
    timed_kill = st.builds(lambda t, a: f"{{at_s: {a}, action: kill, target: {t}}}", target, at)
    stop = st.builds(lambda t, a, d: f"{{at_s: {a}, action: stop, target: {t}, duration_s: {d}}}",
                     target, at, st.sampled_from([2, 4, 6]))
    return st.one_of(phase_kill, timed_kill, stop)


def _until(n_faults: int):
    def missing(run_dir: Path) -> str | None:
        events = jsonl_so_far(run_dir / "events.jsonl")
        done = [e for e in events if e["event"] in ("fault", "fault_skipped")]
        if len(done) < n_faults:
            return f"{len(done)} of {n_faults} faults fired"
        last = max(e.get("fired_at", e["time"]) for e in done)
        cleared = [e["time"] for e in events if e["event"] == "fault_cleared"]
        last = max([last, *cleared])
        after = [r for r in jsonl_so_far(run_dir / "outer_steps.jsonl")
                 if "event" not in r and r.get("accepted") and r["time"] > last]
        if len(after) < 3:
            return f"{len(after)} of 3 outer steps after the last fault"
        applied = min(len(effective_history(jsonl_so_far(run_dir / "followers" / str(i) /
                                                          "applied.jsonl"))) for i in range(2))
        return None if applied >= 10 else f"{applied} of 10 versions applied"
    return missing


@seed(int(time.strftime("%Y%m%d")))
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          phases=[Phase.explicit, Phase.generate])
@given(plan=st.lists(_fault(), min_size=1, max_size=3))
def test_random_fault_plans_keep_the_invariants(tmp_path_factory, plan):
    tmp = tmp_path_factory.mktemp("chaos")
    path = tmp / "faults.yaml"
    path.write_text("faults:\n" + "".join(f"  - {f}\n" for f in plan))
    print("fault plan:\n" + path.read_text())
    launch_until(["--config", str(ROOT / "configs/tiny.yaml"), "--faults", str(path),
                  "--max-time", "600"], tmp / "run", _until(len(plan)), deadline_s=360)
    check_run(tmp / "run")
