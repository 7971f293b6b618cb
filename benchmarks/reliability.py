"""Reliability figures (§12, §16 of the seed): detection and recovery times per fault kind.

Runs `dips launch` once per fault kind — kill -9 of the leader, of follower 0 and of a cluster
in each protocol phase (idle, window, push, update, pull: a failpoint trips at the first such
moment after the fault time), SIGSTOP/SIGCONT of the leader, a follower and a cluster, a cut
link — and reads the run's events:

* detection: fault -> the first event showing the system noticed (the supervisor saw the
  process exit or stop answering; the leader marked a follower down or a cluster removed,
  or saw it restarted),
* recovery: fault -> the next completed outer step (any cluster), and -> the first
  accepted outer step that includes the faulty cluster again after it re-joined (cluster
  faults; this includes the H inner steps it trains before pushing),
* first request served: the first push requested after the fault (by any cluster; refused
  requests count) -> the first outer step decided after that request. The next outer step
  also waits for some cluster to finish its H inner steps (up to a round of the slowest
  cluster on a loaded machine); this figure is what the fault itself cost a ready cluster
  (about the grace window + push + update, ~1.1 s here, when nothing stalls),
* lost: outer steps rolled back by reconciliation, rounds that failed, as a share of all;
  pushes the fault cost (refused after it for another reason than the §8 penalty),
* exactly once: the ledger's accepted windows × tokens per window = the tokens accepted, and
  no more updates accepted than pushed (nothing counted twice, nothing lost).

Prints a table and writes it as JSON (``--out``). Usage:
    python benchmarks/reliability.py --config configs/quickstart.yaml --out runs/reliability
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PHASES = ("idle", "window", "push", "update", "pull")
FAULTS: dict[str, tuple[str, str]] = {}
for _target, _role in (("leader", "leader"), ("follower-0", "follower"), ("cluster-CID", "cluster")):
    for _phase in PHASES:  # issue 10: every role killed in every protocol phase
        FAULTS[f"{_role} kill -9 in {_phase}"] = (
            "{phase: " + _phase + ", after_s: %s, action: kill, target: " + _target + "}", _role)
FAULTS.update({
    "leader hang (SIGSTOP 8 s)": ("{at_s: %s, action: stop, target: leader, duration_s: 8}", "leader"),
    "follower hang (SIGSTOP 5 s)": ("{at_s: %s, action: stop, target: follower-0, duration_s: 5}",
                                    "follower"),
    "cluster hang (SIGSTOP 5 s)": ("{at_s: %s, action: stop, target: cluster-CID, duration_s: 5}",
                                   "cluster"),
    "cluster link cut 5 s": ("{at_s: %s, action: cut_link, target: cluster-CID, duration_s: 5}",
                             "cluster"),
})


def jsonl(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def measure(run_dir: Path, role: str, cid: str) -> dict:
    events = jsonl(run_dir / "events.jsonl")
    lead = jsonl(run_dir / "leader_events.jsonl")
    steps = [r for r in jsonl(run_dir / "outer_steps.jsonl") if "round" in r and "event" not in r]
    fault = next(e for e in events if e["event"] == "fault")
    t0 = fault.get("fired_at", fault["time"])
    name = fault["process"]
    if role == "leader":
        seen = [e["time"] for e in events if e["time"] >= t0 and e["process"] == "leader"
                and e["event"] in ("exited", "unresponsive")]
    elif role == "follower":
        idx = int(name.split("-")[1])
        seen = [e["time"] for e in lead if e["time"] >= t0 and e.get("follower") == idx
                and e["event"] in ("follower_down", "follower_up")]
        seen += [e["time"] for e in lead if e["time"] >= t0 and e["event"] == "reconcile_failed"]
    else:
        seen = [e["time"] for e in lead if e["time"] >= t0 and e.get("cluster") == cid
                and e["event"] in ("cluster_removed", "cluster_joined")]
    after = [r for r in steps if r.get("time", 0) >= t0 and r.get("accepted")]
    # A cluster is back once an accepted step includes it after it re-joined (if it had to).
    rejoined = [e["time"] for e in lead if e["time"] >= t0 and e.get("cluster") == cid
                and e["event"] == "cluster_joined"]
    since = rejoined[0] if rejoined else t0
    back = [r for r in after if cid in r["accepted"] and r["time"] >= since]
    # Push requests after the fault: a sync record is written when it ends; its start is
    # that time minus its push, verdict wait and pull.
    starts = []
    for train in (run_dir / "clusters").glob("*/train.jsonl"):
        for r in jsonl(train):
            push = r.get("push")
            if push:
                start = r["time"] - push.get("push_s", 0) - push.get("wait_s", 0) - push.get("pull_s", 0)
                if start >= t0:
                    starts.append(start)
    served = [r["time"] for r in steps if starts and r.get("time", 0) >= min(starts) and r.get("accepted")]
    summary = json.loads((run_dir / "summary.json").read_text())
    state = json.loads((run_dir / "leader.json").read_text())
    spec = json.loads((run_dir / "run.json").read_text())
    failed = sum(1 for r in steps if r.get("error"))
    total = max(1, summary["outer_steps"] + state["counts"].get("outer_steps_lost", 0) + failed)
    # Pushes the fault cost: refused after it for another reason than the §8 penalty.
    pushes_failed = sum(1 for r in steps if r.get("time", 0) >= t0
                        for x in r.get("rejected", {}).values() if x.get("reason") != "penalty")
    counts = state["counts"]
    once = (state["ledger"]["accepted_windows"] * spec["config"]["inner"]["seq_len"]
            == counts["tokens_accepted"] and counts["updates_accepted"] <= counts["updates_pushed"])
    return {"detect_s": round(min(seen) - t0, 2) if seen else None,
            "pushes_failed": pushes_failed, "exactly_once": once,
            "next_outer_step_s": round(after[0]["time"] - t0, 2) if after else None,
            "request_served_s": round(served[0] - min(starts), 2) if served else None,
            "cluster_back_s": round(back[0]["time"] - t0, 2) if back and role == "cluster" else None,
            "outer_steps": summary["outer_steps"],
            "steps_lost": state["counts"].get("outer_steps_lost", 0), "rounds_failed": failed,
            "lost_share": round((state["counts"].get("outer_steps_lost", 0) + failed) / total, 4),
            "eval_loss_initial": summary["eval_loss_initial"],
            "eval_loss_final": summary["eval_loss_final"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--out", default="runs/reliability")
    ap.add_argument("--at", type=float, default=30.0, help="training time of the fault, s")
    ap.add_argument("--max-time", type=float, default=75.0)
    ap.add_argument("--cluster", default="c1", help="the cluster to fault")
    ap.add_argument("--only", default=None, help="substring of the fault kinds to run")
    ap.add_argument("--report-only", action="store_true",
                    help="measure the runs already in --out again, launch nothing")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for kind, (fault, role) in FAULTS.items():
        if args.only and args.only not in kind:
            continue
        run_dir = out / kind.split(" (")[0].replace(" ", "-")
        if args.report_only:
            if (run_dir / "summary.json").exists():
                rows[kind] = measure(run_dir, role, args.cluster)
            continue
        plan = out / "faults.yaml"
        plan.write_text("faults:\n  - " + (fault % args.at).replace("CID", args.cluster) + "\n")
        t = time.time()
        proc = subprocess.run([sys.executable, "-m", "dips.cli", "launch", "--config", args.config,
                               "--run-dir", str(run_dir), "--max-time", str(args.max_time),
                               "--faults", str(plan)], capture_output=True, text=True,
                              timeout=args.max_time + 400)
        if proc.returncode != 0:
            print(f"{kind}: launch failed\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
            continue
        rows[kind] = measure(run_dir, role, args.cluster)
        rows[kind]["run_s"] = round(time.time() - t, 1)
        print(kind, rows[kind], flush=True)
    if not args.report_only or rows:
        (out / "reliability.json").write_text(json.dumps(rows, indent=1))
    print("\n| fault | detection (s) | next outer step (s) | first request served (s) | "
          "cluster back in a step (s) | steps lost + failed rounds / all | pushes failed | "
          "exactly once | eval loss initial → final |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, r in rows.items():
        print(f"| {kind} | {r['detect_s']} | {r['next_outer_step_s']} | {r['request_served_s']} "
              f"| {r['cluster_back_s'] or '-'} "
              f"| {r['steps_lost'] + r['rounds_failed']} / {r['outer_steps']} ({r['lost_share']:.1%}) "
              f"| {r['pushes_failed']} | {'yes' if r['exactly_once'] else 'NO'} "
              f"| {r['eval_loss_initial']:.2f} → {r['eval_loss_final']:.2f} |")


if __name__ == "__main__":
    main()
