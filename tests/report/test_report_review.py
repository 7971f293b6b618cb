"""``dips report`` on the inputs a fresh review of issue 15 found it wrong on (one test each).

Each input is small and synthetic (the records the roles write, as in tests/report/fixtures.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dips.bench.runreport.build import write_report
from dips.bench.runreport.files import load_run
from dips.bench.runreport.run_plots import cluster_steps, plot_tokens_per_cluster
from dips.emu.summary import tokens_consumed
from dips.spec import ClusterConfig, RunConfig
from tests.report.fixtures import T0


def _jsonl(path: Path, records: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _step(step: int, tokens: int, t: float, loss: float = 5.0) -> dict[str, Any]:
    return {"step": step, "loss": loss, "tokens": tokens, "compute_s": 0.5, "time": T0 + t}


def _resumed_cluster(run: Path) -> Path:
    """Cluster ``a``: killed at step 4 (1,024 tokens), resumed the state saved at step 2
    (512 tokens) and trained steps 3-5 again, then killed and started fresh (step 1)."""
    (run / "train_start").parent.mkdir(parents=True, exist_ok=True)
    (run / "train_start").write_text(str(T0))
    recs = [{"event": "join", "cluster": "a", "version": 0, "time": T0}]
    recs += [_step(s, 256 * s, s) for s in (1, 2, 3, 4)]
    recs += [{"event": "join", "cluster": "a", "version": 1, "time": T0 + 10},
             {"event": "resume", "version": 1, "saved_step": 2, "steps": 2, "tokens": 512,
              "time": T0 + 10}]
    recs += [_step(s, 256 * s, 8 + s) for s in (3, 4, 5)]
    recs += [{"event": "join", "cluster": "a", "version": 2, "time": T0 + 20},
             _step(1, 256, 21)]
    return _jsonl(run / "clusters" / "a" / "train.jsonl", recs)


def test_a_resumed_clusters_tokens_count_each_step_once_as_the_summary_does(tmp_path):
    """Finding 1: the report counted the saved 512 tokens again after a ``resume``
    (1,024 + 1,280 + 256): each step record counts once, 1,024 + 768 + 256."""
    run = tmp_path / "run"
    _resumed_cluster(run)
    cfg = RunConfig(clusters=[ClusterConfig(id="a")])
    expected = 1024 + 768 + 256
    assert tokens_consumed(run, cfg) == {"a": expected}
    files = load_run(run)
    steps = cluster_steps(files, files.clusters["a"])
    assert steps.tokens == [256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert steps.tokens[-1] == expected
    assert steps.lifetimes == [0, 4, 7]  # three processes: the line breaks twice
    plot = plot_tokens_per_cluster(files)
    bars = [p.get_height() for p in plot.figure.axes[0].patches]
    assert bars == [expected]
