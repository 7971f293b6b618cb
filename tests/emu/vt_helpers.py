"""Helpers of the virtual-time tests: the tiny comparison scenario with overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from dips.spec import Scenario

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "compare" / "tiny.yaml"
TOKENS_PER_STEP = 4 * 32  # tiny.yaml: batch 4 x seq_len 32


def tiny(cache_dir: Path, **over: Any) -> Scenario:
    """configs/compare/tiny.yaml with ``over`` applied (top-level keys; nested dicts merged)."""
    data = yaml.safe_load(TINY.read_text())
    data["data"]["cache_dir"] = str(cache_dir)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    if "clusters" in over:
        data.pop("eta", None)
        data.pop("n_clusters", None)
    return Scenario.model_validate(data)


def one_second_scale(params: int) -> float:
    """model_bytes_scale making one transfer exactly 1 s at 10 Gbit: 2·P·scale·8 = 1e10 bits."""
    return 1e10 / (16.0 * params)
