"""The launcher's output off a terminal (issue 15): one line per decided round and per fault
event, read from the run directory's records, and never a table; on a terminal the table stays
and only fault events are printed as lines."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from dips.emu.progress import Progress
from dips.spec import load_config

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)
T0 = 1_000_000.0
BOX = re.compile("[\u2500-\u257f]")  # rich's table rules and borders


def _append(path: Path, *records: dict) -> None:
    with open(path, "a") as f:
        f.writelines(json.dumps(rec) + "\n" for rec in records)


def _decision(rnd: int, version: int, accepted: list[str], rejected: dict | None = None,
              t: float = 10.0) -> dict:
    clusters = [*accepted, *(rejected or {})]
    return {"round": rnd, "version": version, "clusters": clusters, "accepted": accepted,
            "rejected": rejected or {}, "tokens": {c: 1024 for c in clusters},
            "weights": {c: 1 / len(accepted) for c in accepted}, "clip_factor": 0.4,
            "time": T0 + t}


def _round_end(rnd: int, version: int, failed: list[int] | None = None) -> dict:
    return {"event": "round_end", "round": rnd, "version": version,
            "commit_failed": failed or [], "grace": {"mode": "fixed"}, "time": T0 + rnd}


def _status(**losses: float) -> SimpleNamespace:
    return SimpleNamespace(clusters=[SimpleNamespace(cluster_id=c, last_loss=v)
                                     for c, v in losses.items()])


def _progress(run_dir: Path, terminal: bool) -> tuple[Progress, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, width=80)
    return Progress(load_config(ROOT / "configs/tiny.yaml"), console, run_dir, T0), out


def test_off_a_terminal_one_line_per_round_and_per_fault(tmp_path: Path):
    progress, out = _progress(tmp_path, terminal=False)
    with progress.live() as live:
        _append(tmp_path / "outer_steps.jsonl", _decision(1, 1, ["a"], t=12.0), _round_end(1, 1),
                _decision(2, 2, ["a", "c"], {"b": {"score": 9.1, "reason": "penalty", "code": "penalty"}}, t=30.0),
                _round_end(2, 2))
        _append(tmp_path / "events.jsonl",
                {"time": T0 - 5, "event": "start", "process": "cluster-b", "pid": 7},
                {"time": T0 + 20, "event": "exited", "process": "cluster-b", "returncode": -9},
                {"time": T0 + 20.5, "event": "restart", "process": "cluster-b", "pid": 8})
        _append(tmp_path / "leader_events.jsonl",
                {"time": T0 + 1, "event": "cluster_joined", "cluster": "b", "rejoin": False},
                {"time": T0 + 19, "event": "cluster_removed", "cluster": "b", "silent_s": 3.1},
                {"time": T0 + 25, "event": "cluster_joined", "cluster": "b", "rejoin": True})
        live.update("a table that must not be drawn")
        progress.log(_status(a=5.5, b=6.0, c=6.5))
        progress.log(_status(a=5.4))  # nothing new recorded: nothing printed
    text = out.getvalue()
    lines = text.splitlines()
    assert not BOX.search(text) and "table" not in text
    assert lines[0].startswith("training: clusters a (x1.00), b (x1.50, 2 stages)")
    assert lines[1:] == [  # in time order, whichever file recorded it
        ("[    12 s] outer step v1 (round 1): accepted a; train loss 5.500; "
         "tokens 1,024/20M"),
        "[    19 s] cluster_removed: leader cluster=b silent_s=3.1",
        "[    20 s] exited: cluster-b returncode=-9",
        "[    20 s] restart: cluster-b",
        "[    25 s] cluster_joined: leader cluster=b rejoin=True",
        ("[    30 s] outer step v2 (round 2): accepted a, c; rejected b (penalty); "
         "train loss 6.000; tokens 3,072/20M")]


def test_half_written_lines_wait_and_rollbacks_take_tokens_back(tmp_path: Path):
    progress, out = _progress(tmp_path, terminal=False)
    path = tmp_path / "outer_steps.jsonl"
    _append(path, _decision(1, 1, ["a"]))
    whole = json.dumps(_decision(2, 2, ["b"]))
    with open(path, "a") as f:
        f.write(whole[:20])  # the leader is still writing this line
    progress.log()
    assert len([ln for ln in out.getvalue().splitlines() if "outer step" in ln]) == 1
    with open(path, "a") as f:
        f.write(whole[20:] + "\n")
    _append(path, {**_round_end(2, 2, failed=[1]), "time": T0 + 11},
            {"event": "rollback", "version": 1, "lost": 1, "time": T0 + 30},
            _decision(3, 2, ["c"], t=40.0),
            _decision(4, 2, [], {"a": {"score": 8.0, "reason": "penalty", "code": "penalty"}}, t=50.0))
    progress.log()
    lines = out.getvalue().splitlines()
    assert lines[1:] == [
        "[    10 s] outer step v2 (round 2): accepted b; tokens 2,048/20M",
        "[    11 s] commit_failed: leader round=2 version=2 followers=[1]",
        "[    30 s] rollback: leader version=1 lost=1",
        "[    40 s] outer step v2 (round 3): accepted c; tokens 2,048/20M",
        "[    50 s] round 4: nothing applied; rejected a (penalty); tokens 2,048/20M"]


def test_on_a_terminal_the_table_stays_and_only_faults_are_lines(tmp_path: Path):
    progress, out = _progress(tmp_path, terminal=True)
    _append(tmp_path / "outer_steps.jsonl", _decision(1, 1, ["a"]), _round_end(1, 1))
    _append(tmp_path / "events.jsonl",
            {"time": T0 + 3, "event": "exited", "process": "follower-0", "returncode": 1})
    live = progress.live()
    assert type(live).__name__ == "Live"
    progress.log()
    text = out.getvalue()
    assert "exited: follower-0 returncode=1" in text and "outer step" not in text


def test_a_follower_down_is_one_line_its_failed_rounds_one_more_and_its_return_one(tmp_path):
    """Review of issue 15, #6: with a follower down, each round's line repeated the same
    gRPC error once per cluster, round after round (5.4-8.5 KB per minute of log). The
    rejections are grouped by their typed reason with the text once, rounds alike are counted
    in one line, a follower_down is said once, and its return once."""
    progress, out = _progress(tmp_path, terminal=False)
    err = ("round failed: UNAVAILABLE: failed to connect to all addresses; last error: "
           "UNKNOWN: ipv4:127.0.0.1:40123: Failed to connect to remote host: Connection refused")
    failed = {c: {"score": None, "reason": err, "code": "round_failed"} for c in "abcd"}
    records = [_decision(1, 1, ["a"], t=5.0)]
    records += [{**_decision(r, 1, [], failed, t=5.0 + r), "error": err} for r in range(2, 12)]
    records += [_decision(12, 2, ["a", "b"], t=20.0)]
    _append(tmp_path / "outer_steps.jsonl", *records)
    _append(tmp_path / "leader_events.jsonl",
            {"time": T0 + 6.5, "event": "follower_down", "follower": 1, "cause": "data plane",
             "error": err},
            {"time": T0 + 9.5, "event": "follower_down", "follower": 1, "silent_s": 3.0},
            {"time": T0 + 18.5, "event": "follower_up", "follower": 1, "incarnation": 1,
             "restarted": False},
            {"time": T0 + 19.0, "event": "follower_up", "follower": 1, "incarnation": 1,
             "restarted": False})
    progress.log()
    lines = out.getvalue().splitlines()
    assert [ln[:30] for ln in lines] == [
        "[     5 s] outer step v1 (roun",
        "[     6 s] follower_down: lead",
        "[     7 s] round 2: nothing ap",
        "[    16 s] rounds 3-11: 9 more",
        "[    18 s] follower_up: leader",
        "[    20 s] outer step v2 (roun"]
    assert lines[2].count("UNAVAILABLE") == 2  # the round's error, and a-d's text once
    assert "a, b, c, d (round_failed: round failed: UNAVAILABLE" in lines[2]
    assert lines[4] == "[    18 s] follower_up: leader follower=1 serving again after 12 s down"
    assert all(len(ln) < 400 for ln in lines)
    # rounds alike at the end of the run: counted by the launcher's last call
    _append(tmp_path / "outer_steps.jsonl",
            *[{**_decision(r, 2, [], failed, t=r + 10.0), "error": err} for r in (13, 14, 15)])
    progress.log(final=True)
    tail = out.getvalue().splitlines()[len(lines):]
    assert [ln[:30] for ln in tail] == ["[    23 s] round 13: nothing a",
                                        "[    25 s] rounds 14-15: 2 mor"]


def test_the_pushes_withdrawn_at_the_runs_end_are_said_as_such(tmp_path: Path):
    """Review 33 of issue 15, m3: clusters leaving the run (it finished) are not rejected."""
    progress, out = _progress(tmp_path, terminal=False)
    gone = {"reason": "cluster left", "tokens": 1024}
    with progress.live():
        _append(tmp_path / "outer_steps.jsonl",
                {**_decision(4, 3, []), "withdrawn": {"a": gone, "b": gone}, "time": T0 + 40})
        progress.log(_status())
    assert out.getvalue().splitlines()[1:] == [
        "[    40 s] round 4: nothing applied; withdrawn a, b (left the run); tokens 0/20M"]
