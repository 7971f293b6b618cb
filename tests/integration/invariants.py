"""Checks of DESIGN.md's invariants on the outputs of a `dips launch` run directory."""

from __future__ import annotations

import json
from pathlib import Path


def jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def effective_history(lines: list[dict]) -> list[dict]:
    """A follower's applied.jsonl with every rolled-back version removed (restore events)."""
    hist: list[dict] = []
    for r in lines:
        if r.get("event") == "restore":
            hist = [h for h in hist if h["version"] <= r["version"]]
        else:
            hist.append(r)
    return hist


def check_run(run_dir: Path, followers: int = 2, seq_len: int = 64, evaluated: bool = True) -> dict:
    """Assert the invariants; returns figures for the caller's own checks. ``evaluated``:
    the summary holds a final evaluation that must be below the initial one."""
    summary = json.loads((run_dir / "summary.json").read_text())
    hists = [effective_history(jsonl(run_dir / "followers" / str(i) / "applied.jsonl"))
             for i in range(followers)]
    key = [[(h["version"], h["round"], h["accepted"], h["weights"], h["clip_factor"])
            for h in hist] for hist in hists]
    # Every follower applied the same accepted sets and clip factors, version by version.
    assert all(k == key[0] for k in key), "followers disagree on the applied outer steps"
    versions = [k[0] for k in key[0]]
    assert versions == list(range(1, len(versions) + 1)), f"versions not consecutive: {versions}"
    final = versions[-1] if versions else 0
    assert summary["final_version"] == final
    # Each accepted update applied exactly once.
    pairs = [(h["round"], c) for h in hists[0] for c in h["accepted"]]
    assert len(pairs) == len(set(pairs)), "an accepted update was applied twice"
    # The leader's decisions match what the followers applied.
    lead: dict[int, dict] = {}
    for r in jsonl(run_dir / "outer_steps.jsonl"):
        if r.get("event") == "rollback":
            lead = {v: x for v, x in lead.items() if v <= r["version"]}
        elif r.get("accepted") and not r.get("error"):
            # A version decided again without a rollback between: the log claimed a step
            # the model did not hold (review 33 of issue 15, M1).
            assert r["version"] not in lead, f"version {r['version']} decided twice"
            lead[r["version"]] = r
    # Per cluster the summary's counts add up to its totals (the same records, review 33).
    # (A hand-deployed run's view, test_multihost's and test_mixed_clusters', has no launcher
    # summary to check: only its final version.)
    per = summary.get("per_cluster") or {}
    for key in ("updates_pushed", "updates_accepted", "updates_rejected", "tokens_accepted"):
        if per:
            assert sum(row[key] for row in per.values()) == summary[key], (key, per, summary)
    for h in hists[0]:
        assert h["version"] in lead, f"version {h['version']} applied but not decided"
        assert lead[h["version"]]["accepted"] == h["accepted"]
        assert lead[h["version"]]["clip_factor"] == h["clip_factor"]
    # Shard parameters, momentum and checkpoint carry the same version: the newest complete
    # checkpoint of every follower is the final version, with the final checksum.
    for i, hist in enumerate(hists):
        ckpts = sorted((run_dir / "followers" / str(i) / "checkpoints").glob("v*/meta.json"))
        meta = json.loads(ckpts[-1].read_text())
        assert meta["version"] == final, f"follower {i} checkpoint {meta['version']} != {final}"
        if hist:
            assert meta["checksum"] == hist[-1]["checksum"]
    # The ledger accounts for every accepted window exactly once.
    state = json.loads((run_dir / "leader.json").read_text())
    from dips.algo.ledger import ChunkLedger

    ledger = ChunkLedger.from_dict(state["ledger"])  # runs the ledger's own invariant check
    assert ledger.accepted_windows * seq_len == state["counts"]["tokens_accepted"]
    accepted_tokens = sum(lead[v]["tokens"][c] for v in versions for c in lead[v]["accepted"])
    assert accepted_tokens == state["counts"]["tokens_accepted"], \
        f"{accepted_tokens} tokens behind applied versions != {state['counts']['tokens_accepted']}"
    counts = state["counts"]
    assert counts["updates_accepted"] <= counts["updates_pushed"], counts
    assert counts["tokens_accepted"] <= counts["tokens_pushed"], counts
    # Every decision line carries the ledger's T_j: windows x tokens per window.
    for v in versions:
        assert all(t % seq_len == 0 and t > 0 for t in lead[v]["tokens"].values()), lead[v]
    if evaluated:
        assert summary["eval_loss_final"] < summary["eval_loss_initial"] - 0.3
    return {"summary": summary, "final_version": final, "state": state}
