"""Shared fixtures for tests/train: one session cache (tokenizer + tokens at vocab 512)."""

from __future__ import annotations

import os
import pathlib

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TINY_VOCAB = 512


@pytest.fixture(scope="session")
def train_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Session-wide cache folder for tokenizer and token files."""
    return tmp_path_factory.mktemp("dips-train-cache")


@pytest.fixture(scope="session")
def tiny_tokens(train_cache_dir: pathlib.Path):
    """TokenData at vocab 512, full train split (encoded once per session)."""
    from dips.train.corpus import load_tokens

    return load_tokens(train_cache_dir, vocab_size=TINY_VOCAB)


@pytest.fixture(scope="session")
def tiny_cfg():
    """A ~40k-parameter LLaMA config for fast tests."""
    from dips.spec import ModelConfig

    return ModelConfig(
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=TINY_VOCAB,
        max_seq_len=64,
    )
