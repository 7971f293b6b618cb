"""``summary.json``'s times and losses (a fresh review of issue 15, #7 and #9): training time
is the training only, the shutdown and the final evaluation are counted on their own, and
losses keep their full precision in the file (only the launcher's display rounds them)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from dips.emu.progress import summary_table
from dips.emu.summary import export_and_summarize
from dips.spec import ClusterConfig, RunConfig


def test_times_are_split_and_losses_are_not_rounded(tmp_path: Path):
    cfg = RunConfig(clusters=[ClusterConfig(id="a")])
    (tmp_path / "clusters" / "a").mkdir(parents=True)
    (tmp_path / "clusters" / "a" / "train.jsonl").write_text(
        "".join(json.dumps({"step": s, "tokens": 256 * s}) + "\n" for s in (1, 2, 3, 4)))
    spec = SimpleNamespace(cache_dir=tmp_path, params=1000, eval_loss_initial=8.123456789012)
    times = {"train_time_s": 100.0, "shutdown_s": 7.25, "final_eval_s": 12.5}
    s = export_and_summarize(cfg, tmp_path, spec, None, None, 0.0, times, False)
    assert s["train_time_s"] == 100.0 and s["shutdown_s"] == 7.25
    assert s["final_eval_s"] >= 12.5  # plus this call's own export (none here: no key)
    assert s["tokens_per_s"] == 10.2  # 1,024 tokens over the training only (100 s)
    assert s["eval_loss_initial"] == 8.123456789012  # was rounded to 8.12346
    assert json.loads((tmp_path / "summary.json").read_text())["eval_loss_initial"] == \
        8.123456789012
    shown = summary_table({**s, "eval_loss_final": 6.987654321, "run_dir": "r"})
    assert "eval_loss_initial  8.1235" in shown and "eval_loss_final    6.9877" in shown
    assert "train_time_s       100.0" in shown and "final_eval_s" in shown
