"""Small synthetic inputs for ``dips report``: a run copied from several hosts, comparisons.

The run (:func:`make_multihost_run`) has two clusters, ``site-a`` (one process restart, two
syncs, then a third after the restart) and ``site-b`` (one sync), three rounds (round 1 in
warm-up, round 2 rejects ``site-b`` with per-cluster ``thresholds``, round 3 in the older
single-``threshold`` form), two followers, a held-out evaluation event, and two bad lines in
``outer_steps.jsonl`` (lines 3 and 5).  Each role's files lie in a host folder of its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

T0 = 1_800_000_000.0  # epoch seconds of the synthetic training start


def _jsonl(path: Path, records: list[Any], raw: dict[int, str] | None = None) -> None:
    """Write ``records`` one per line; ``raw`` puts a literal line at a 1-based line number."""
    lines = [json.dumps(r) for r in records]
    for no, text in sorted((raw or {}).items()):
        lines.insert(no - 1, text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _push(version: int, rnd: int, accepted: bool = True) -> dict[str, Any]:
    return {"accepted": accepted, "ok": True, "version": version, "round": rnd, "tokens": 300,
            "score": None, "reason": "accepted" if accepted else "penalty",
            "push_s": 0.1, "wait_s": 0.2, "pull_s": 0.05}


def _steps(first: int, n: int, t_start: float, tok0: int, syncs: dict[int, dict]) -> list[dict]:
    return [{"step": s, "loss": 8.0 - 0.1 * s, "tokens": tok0 + 100 * (s - first + 1),
             "compute_s": 0.5, "time": t_start + (s - first + 1),
             **({"push": syncs[s]} if s in syncs else {})}
            for s in range(first, first + n)]


def make_multihost_run(root: Path) -> Path:
    """Write the run of the module docstring under ``root``; returns ``root``."""
    leader = root / "host-leader" / "var" / "lib" / "dips" / "leader"
    leader.mkdir(parents=True)
    (leader / "summary.json").write_text(json.dumps({
        "method": "di-ps", "cluster_ids": ["site-a", "site-b"], "clusters": 2, "followers": 2,
        "tokens_consumed_per_cluster": {"site-a": 800, "site-b": 400}, "tokens_accepted": 900,
        "eval_loss_initial": 8.3, "eval_loss_final": 6.9, "train_time_s": 12.0}))
    (leader / "train_start").write_text(str(T0))
    rounds = [
        {"round": 1, "version": 1, "clusters": ["site-a"], "accepted": ["site-a"], "rejected": {},
         "scores": {"site-a": None}, "threshold": None, "tokens": {"site-a": 300},
         "base_versions": {"site-a": 0}, "window_s": 1.0, "push_s": 0.1, "update_s": 0.05,
         "time": T0 + 3.6},
        {"event": "round_end", "round": 1, "version": 1, "pull_s": 0.0, "time": T0 + 3.7},
        {"round": 2, "version": 2, "clusters": ["site-a", "site-b"], "accepted": ["site-a"],
         "rejected": {"site-b": {"score": 5.0, "reason": "penalty"}},
         "scores": {"site-a": -1.0, "site-b": 5.0}, "thresholds": {"site-a": 3.0, "site-b": 2.5},
         "tokens": {"site-a": 300, "site-b": 400}, "base_versions": {"site-a": 1, "site-b": 0},
         "window_s": 1.0, "push_s": 0.1, "update_s": 0.05, "time": T0 + 6.6},
        {"round": 3, "version": 3, "clusters": ["site-b"], "accepted": ["site-b"], "rejected": {},
         "scores": {"site-b": 0.5}, "threshold": 3.0, "tokens": {"site-b": 300},
         "base_versions": {"site-b": 1}, "window_s": 1.0, "push_s": 0.1, "update_s": 0.05,
         "time": T0 + 9.6},
    ]
    _jsonl(leader / "outer_steps.jsonl", rounds, raw={3: "{not json", 5: "[1, 2]"})
    _jsonl(leader / "leader_events.jsonl", [
        {"time": T0 + 7.0, "event": "eval", "version": 2, "eval_loss": 7.5, "tokens_accepted": 600}])
    _jsonl(leader / "events.jsonl", [{"time": T0 + 13.0, "event": "stop", "reason": "max time"}])
    a = root / "host-a" / "srv" / "site-a" / "train.jsonl"
    _jsonl(a, [{"event": "join", "version": 0, "time": T0}]
           + _steps(1, 6, T0, 0, {3: _push(1, 1), 6: _push(2, 2)})
           + [{"event": "join", "version": 2, "time": T0 + 6.5}]
           + _steps(1, 2, T0 + 6.5, 0, {}))
    b = root / "host-b" / "dips" / "cluster-site-b" / "train.jsonl"
    _jsonl(b, [{"event": "join", "version": 0, "time": T0 + 0.5}]
           + _steps(1, 4, T0 + 0.5, 0, {4: _push(2, 2, accepted=False)}))
    for f in ("ps0", "ps1"):
        _jsonl(root / f"host-{f}" / f / "applied.jsonl",
               [{"version": v, "round": v, "accepted": [], "time": T0 + 3.6 * v} for v in (1, 2, 3)])
    return root


def curve(losses: list[float], step_s: float = 100.0, tokens: int = 1000) -> list[dict[str, float]]:
    """A ``MethodResult.curve``: one point per loss, ``step_s`` s and ``tokens`` apart."""
    return [{"time_s": i * step_s, "tokens": i * tokens, "eval_loss": v} for i, v in enumerate(losses)]


def make_compare(root: Path) -> Path:
    """A ``dips bench compare`` output: three methods (``di-ps-no-clip`` diverges) and the
    Di-PS method's events (two rounds)."""
    results = [{"method": "di-ps", "curve": curve([7.6, 6.0, 5.0]), "final_eval_loss": 5.0,
                "tokens_per_s": 10.0, "time_s": 200.0},
               {"method": "diloco", "curve": curve([7.6, 6.5, 5.5]), "final_eval_loss": 5.5,
                "tokens_per_s": 8.0, "time_s": 200.0},
               {"method": "di-ps-no-clip", "curve": curve([7.6, 6.9, 11719.0]),
                "final_eval_loss": 11719.0, "tokens_per_s": 10.0, "time_s": 200.0}]
    root.mkdir(parents=True, exist_ok=True)
    (root / "compare.json").write_text(json.dumps(
        {"scenario": "eta100", "kind": "compare", "mode": "virtual", "results": results}))
    _jsonl(root / "methods" / "di-ps" / "events.jsonl", [
        {"round": 1, "version": 1, "clusters": ["c0"], "accepted": ["c0"], "scores": {"c0": None},
         "threshold": None, "base_versions": {"c0": 0}, "time": 24.5},
        {"round": 2, "version": 2, "clusters": ["c0", "c1"], "accepted": ["c0", "c1"],
         "scores": {"c0": 0.2, "c1": -0.4}, "threshold": 3.0, "base_versions": {"c0": 1, "c1": 0},
         "time": 32.5}])
    return root


def make_weak_scaling(root: Path) -> Path:
    """A weak-scaling comparison: 1 and 2 clusters, two methods each."""
    runs = {str(n): [{"method": m, "clusters": n, "curve": curve([7.6, 6.0 + d])}
                     for m, d in (("di-ps", 0.0), ("diloco", 0.1))] for n in (1, 2)}
    root.mkdir(parents=True, exist_ok=True)
    (root / "compare.json").write_text(json.dumps(
        {"scenario": "ws", "kind": "weak-scaling", "mode": "virtual", "runs": runs}))
    return root


def make_host_copies(root: Path, named: bool) -> Path:
    """A hand-deployed run copied from its hosts, each host's state directory called
    ``state`` (no launcher files: no ``summary.json``, no ``train_start``): the leader started
    30 s before the first cluster joined (at T0), the evaluator reported version 0 at T0 - 5;
    clusters a (host ``east``) and b (host ``west``), followers 0 and 1. ``named``: the files name their owner (a join
    record's ``cluster``, an applied record's ``follower``), as this version writes them;
    else they do not (older files), and only their folders tell them apart."""
    leader = root / "host-leader" / "state"
    _jsonl(leader / "leader_events.jsonl", [
        {"time": T0 - 30.0, "event": "follower_up", "follower": 0},
        {"time": T0 - 29.0, "event": "follower_up", "follower": 1},
        {"time": T0, "event": "cluster_joined", "cluster": "a", "rejoin": False, "version": 0},
        {"time": T0 + 0.5, "event": "cluster_joined", "cluster": "b", "rejoin": False,
         "version": 0}])
    _jsonl(leader / "eval.jsonl", [{"time": T0 - 5.0, "version": 0, "tokens_accepted": 0,
                                    "eval_loss": 8.3}])
    _jsonl(leader / "outer_steps.jsonl", [
        {"round": r, "version": r, "clusters": ["a", "b"], "accepted": ["a", "b"],
         "rejected": {}, "scores": {}, "tokens": {"a": 300, "b": 300},
         "base_versions": {"a": r - 1, "b": r - 1}, "window_s": 0.5, "push_s": 0.1,
         "update_s": 0.05, "time": T0 + 3.0 * r} for r in (1, 2, 3)])
    for cid, host, t_join in (("a", "east", T0), ("b", "west", T0 + 0.5)):
        join = {"event": "join", "version": 0, "time": t_join, **({"cluster": cid} if named else {})}
        _jsonl(root / host / "state" / "train.jsonl",
               [join] + _steps(1, 9, t_join, 0, {3: _push(1, 1), 6: _push(2, 2), 9: _push(3, 3)}))
    for f in (0, 1):
        _jsonl(root / f"host-f{f}" / "state" / "applied.jsonl",
               [{"version": v, "round": v, "accepted": ["a", "b"], "time": T0 + 3.0 * v,
                 **({"follower": f} if named else {})} for v in (1, 2, 3)])
    return root


def make_outage_run(root: Path) -> Path:
    """A launch run (``train_start`` T0) of one cluster syncing every second from 0 to 20 s
    and from 60 to 80 s, the leader's rounds with them, and nothing between: a 40 s outage in
    the middle of the run."""
    (root / "train_start").parent.mkdir(parents=True, exist_ok=True)
    (root / "train_start").write_text(str(T0))
    times = [float(t) for t in range(1, 21)] + [float(t) for t in range(61, 81)]
    _jsonl(root / "outer_steps.jsonl", [
        {"round": i + 1, "version": i + 1, "clusters": ["a"], "accepted": ["a"], "rejected": {},
         "scores": {}, "tokens": {"a": 100}, "base_versions": {"a": i}, "window_s": 0.2,
         "push_s": 0.05, "update_s": 0.05, "time": T0 + t + 0.3} for i, t in enumerate(times)])
    steps: list[dict[str, Any]] = [{"event": "join", "cluster": "a", "version": 0, "time": T0}]
    for i, t in enumerate(times):
        steps.append({"step": i + 1, "loss": 5.0, "tokens": 100 * (i + 1), "compute_s": 0.5,
                      "time": T0 + t + 0.5, "push": _push(i + 1, i + 1)})
    _jsonl(root / "clusters" / "a" / "train.jsonl", steps)
    return root
