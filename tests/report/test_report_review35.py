"""``dips report``'s timeline after review 35 of issue 15, F1: a sync is drawn from its
``sync_start`` record to its step's line, so a sync blocked on a leader that does not answer
is never drawn as inner steps, and a sync no line ends (the process ended in it) is drawn
to its process's end, or open to the run's end. Inputs are synthetic, shaped like the
review's race run (the leader SIGSTOPped while every cluster was in a sync)."""

from __future__ import annotations

import pytest

from dips.bench.runreport.build import write_report
from dips.bench.runreport.files import load_run
from dips.bench.runreport.timeline import sync_bars
from dips.bench.runreport.zoom import OPEN
from tests.report.fixtures import T0, _jsonl, _push
from tests.report.test_report_review33 import _bars

pytestmark = pytest.mark.timeout(120)

UNFINISHED = "sync, no end recorded"
BLOCKED = (12.26, 16.51)  # a's sync that waited on the frozen leader (s since the start)


def _syncs(cid: str, until: float) -> list[dict]:
    """Join at 0, an inner step every 0.5 s, a sync every second step: its ``sync_start``
    when the step is trained, its line 0.35 s later (push 0.1, wait 0.2, pull 0.05)."""
    recs: list[dict] = [{"event": "join", "cluster": cid, "version": 0, "time": T0}]
    t = 0.0
    for i in range(1, int(2 * until) + 1):
        t += 0.5
        rec = {"step": i, "loss": 5.0, "tokens": 100 * i, "compute_s": 0.3, "time": T0 + t}
        if i % 2 == 0:
            recs.append({"event": "sync_start", "inner_step": i, "tokens": 100 * i,
                         "time": T0 + t})
            t += 0.35
            rec = {**rec, "time": T0 + t, "push": _push(i // 2, i // 2)}
        recs.append(rec)
    return recs


def make_frozen_leader_run(root, wait_s: float = 0.0):
    """a: syncs to ~10 s, trains on to 12.26 s, then a sync whose verdict never came (the
    leader frozen) ends at 16.51 s (``wait_s`` as recorded: 0.0 before the fix of
    :mod:`dips.roles.client_sync`); b: a sync begun at 20 s, its process killed at 22 s;
    c: a sync begun at 25 s that nothing ends (still in it at the stop, 30 s)."""
    root.mkdir(parents=True)
    (root / "train_start").write_text(str(T0))
    a = _syncs("a", 8.0)
    last = a[-1]["time"] - T0
    a += [{"step": 20 + k, "loss": 5.0, "tokens": 2000 + 100 * k, "compute_s": 0.3,
           "time": T0 + last + 0.5 * k} for k in range(1, int((BLOCKED[0] - last) / 0.5) + 1)]
    a += [{"event": "sync_start", "inner_step": 40, "tokens": 4000, "time": T0 + BLOCKED[0]},
          {"step": 40, "loss": 5.0, "tokens": 4000, "compute_s": 0.3, "time": T0 + BLOCKED[1],
           "push": {**_push(9, 12, accepted=False), "ok": False, "push_s": 0.0226,
                    "wait_s": wait_s, "pull_s": 0.0,
                    "reason": "verdict of push p40 pending: UNAVAILABLE"}},
          {"step": 41, "loss": 5.0, "tokens": 4100, "compute_s": 0.3, "time": T0 + 17.0}]
    _jsonl(root / "clusters" / "a" / "train.jsonl", a)
    _jsonl(root / "clusters" / "b" / "train.jsonl", _syncs("b", 8.0) + [
        {"event": "sync_start", "inner_step": 30, "tokens": 3000, "time": T0 + 20.0}])
    _jsonl(root / "clusters" / "c" / "train.jsonl", _syncs("c", 8.0) + [
        {"event": "sync_start", "inner_step": 30, "tokens": 3000, "time": T0 + 25.0}])
    _jsonl(root / "outer_steps.jsonl", [
        {"round": r, "version": r, "clusters": ["a", "b"], "accepted": ["a", "b"], "rejected": {},
         "scores": {}, "tokens": {"a": 100, "b": 100}, "window_s": 0.3, "push_s": 0.1,
         "update_s": 0.05, "time": T0 + r + 0.05} for r in range(1, 9)])
    _jsonl(root / "events.jsonl", [
        {"time": T0 + 22.0, "event": "exited", "process": "cluster-b", "returncode": -9},
        {"time": T0 + 30.0, "event": "stop", "process": "launcher", "reason": "max time"}])
    return root


def _overlaps(bars: list[tuple[float, float]], lo: float, hi: float) -> list:
    return [(s, w) for s, w in bars if s < hi - 1e-6 and s + w > lo + 1e-6]  # epoch floats


@pytest.mark.parametrize("wait_s", [0.0, 4.2])  # as recorded before the fix, and after it
def test_a_sync_blocked_on_the_leader_is_drawn_as_waiting_not_training(tmp_path, wait_s):
    """Review 35 F1: a's 4.25 s in a sync were drawn as inner steps (all but its 0.02 s
    push), from the recorded push, wait (0.0) and pull laid back before the step's line."""
    run = load_run(make_frozen_leader_run(tmp_path / "run", wait_s))
    a = sync_bars(run, run.clusters["a"], "a")
    assert not _overlaps(a["inner steps"], *BLOCKED)
    assert a["push"][-1] == pytest.approx((BLOCKED[0], 0.0226))
    start, width = a["wait"][-1]
    assert (start, start + width) == pytest.approx((BLOCKED[0] + 0.0226, BLOCKED[1]))
    assert a["inner steps"][-2][0] + a["inner steps"][-2][1] == pytest.approx(BLOCKED[0])
    assert a["inner steps"][-1] == pytest.approx((BLOCKED[1], 17.0 - BLOCKED[1]))
    # a normal sync: push from its sync_start, the pull ending at its line
    assert a["push"][0] == pytest.approx((1.0, 0.1)) and a["pull"][0] == pytest.approx((1.3, 0.05))


def test_a_sync_no_record_ends_is_drawn_to_its_process_end_or_open(tmp_path):
    """b was killed in a sync: drawn to its exit (22 s), not open; c was still in one at
    the end: drawn to the run's end (30 s), open. Both were drawn as nothing at all, and
    their inner steps ended at their previous sync."""
    run = load_run(make_frozen_leader_run(tmp_path / "run"))
    b = sync_bars(run, run.clusters["b"], "b")
    assert b[UNFINISHED] == [(20.0, 2.0)] and b[OPEN] == []
    assert b["inner steps"][-1][0] + b["inner steps"][-1][1] == pytest.approx(20.0)
    c = sync_bars(run, run.clusters["c"], "c")
    assert c[UNFINISHED] == [(25.0, 5.0)] and c[OPEN] == [(25.0, 5.0)]
    rep = write_report(run.root, tmp_path / "out")
    ax = next(p for p in rep.plots if p.name == "timeline.png").figure.axes[0]
    labels = [label for label, _ in _bars(ax, 2)]  # the rows: leader, a, b, c
    assert UNFINISHED in labels
