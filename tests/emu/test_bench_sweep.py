"""The equal-token comparison and run reuse of benchmarks/compare/bench_sweep.py (issue 12)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.emu.vt_helpers import ROOT, tiny

pytestmark = pytest.mark.timeout(60)
_spec = importlib.util.spec_from_file_location(
    "bench_sweep", ROOT / "benchmarks" / "compare" / "bench_sweep.py")
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)
CACHE = ROOT / ".cache" / "dips"


def test_diloco_loss_is_read_at_dips_tokens_between_its_evaluations():
    # DiLoCo's evaluations (tokens, time, loss) at its budget and one round further.
    curve = [[0, 0.0, 7.6], [589824, 900.0, 5.6778], [688128, 1000.0, 5.5548]]
    # Di-PS's model holds 630,784 tokens: 41,666/98,304 = 0.41667 of the way.
    assert sweep._at_tokens(curve, 630784) == pytest.approx(5.6778 - 0.41667 * 0.123, abs=1e-5)
    assert sweep._at_tokens(curve, 589824) == pytest.approx(5.6778)
    with pytest.raises(ValueError, match="tokens = 700000 outside"):
        sweep._at_tokens(curve, 700000)


def test_one_round_more_adds_every_clusters_h_steps():
    sc = tiny(CACHE)  # 3 clusters, H = 4, batch 4 x 32 tokens
    more = sweep._one_round_more(sc)
    assert more.token_budget - sc.token_budget == 3 * 4 * 4 * 32
    assert more.model_copy(update={"token_budget": sc.token_budget}) == sc


def test_one_diloco_run_serves_every_dips_setting(tmp_path: Path):
    sc = tiny(CACHE)

    def over(**outer):
        return sc.model_copy(update={"outer": sc.outer.model_copy(update=outer)})

    key = sweep._saved(tmp_path, sc, "diloco")
    # What DiLoCo does not use leaves its run's key alone; what it uses changes it.
    assert sweep._saved(tmp_path, over(clip="seed", staleness="none"), "diloco") == key
    assert sweep._saved(tmp_path, over(wire_dtype="fp32"), "diloco") != key
    assert sweep._saved(tmp_path, over(lr=0.5), "diloco") != key
    assert sweep._saved(tmp_path, over(clip="seed"), "di-ps") != sweep._saved(tmp_path, sc, "di-ps")
    assert sweep._diloco_part({"outer": {"clip": "seed", "lr": 0.5}, "penalty": {"beta": 1.0}}) \
        == {"outer": {"lr": 0.5}}
