"""Bring your own model and data (issue 14), in one process: a pretrained model directory
loaded as version 0, local JSON-lines / text / Parquet files tokenised once into a memmap
cache, pre-tokenised ``train.bin``/``val.bin`` mapped lazily, and every mismatch between the
model's and the data's vocabulary refused naming both values."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dips.spec import DataConfig, ModelConfig, RunConfig
from dips.train.datasource import DIGEST_BLOCKS, DIGEST_TOKENS, load_data, load_vocab, save_tokenizer
from dips.train.model import build_model, check_built
from dips.roles.layers import blocks_prefix, layer_table
from tests.train import byo

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """A tokenizer directory, a JSONL dataset directory and its ids (uint16)."""
    root = tmp_path_factory.mktemp("byo")
    texts = byo.paragraphs(200_000)
    tok = byo.make_tokenizer(root / "tok", texts)
    return {"root": root, "texts": texts, "tok": tok, "data": byo.make_jsonl(root / "data", texts),
            "ids": byo.encode(tok, texts)}


def _json(user, cache: Path, **over) -> DataConfig:
    return DataConfig(**{"format": "json", "path": str(user["data"]), "tokenizer": user["tok"],
                         "vocab_size": byo.VOCAB, "cache_dir": cache, **over})


def test_jsonl_is_tokenised_once_into_a_memmap_that_every_host_rebuilds_identically(user, tmp_path):
    data = load_data(_json(user, tmp_path / "a"))
    assert isinstance(data.train, np.memmap) and isinstance(data.val, np.memmap)
    assert data.train.dtype == np.uint16 and data.vocab_size == byo.VOCAB
    # Every document's ids and its EOS land in exactly one split; ~val_fraction held out.
    total = len(user["ids"])
    assert len(data.train) + len(data.val) >= total
    assert abs(len(data.val) / total - 0.02) < 0.01
    folder = next((tmp_path / "a" / "datasets").iterdir())
    stamp = (folder / "train.bin").stat().st_mtime_ns
    again = load_data(_json(user, tmp_path / "a"))  # the cache is reused, not rewritten
    assert (folder / "train.bin").stat().st_mtime_ns == stamp
    other = load_data(_json(user, tmp_path / "b"))  # another host's own cache: same bytes
    assert np.array_equal(other.train, again.train) and np.array_equal(other.val, again.val)
    eos = 0  # the tokenizer's <|endoftext|>
    assert int(data.train[-1]) == eos and int(data.val[-1]) == eos
    capped = load_data(_json(user, tmp_path / "a", max_train_tokens=5000))
    assert len(capped.train) == 5000 and isinstance(capped.train, np.memmap)


def test_text_and_parquet_files_give_the_same_kind_of_stream(user, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = user["texts"][:400]
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "book.txt").write_text("\n\n".join(texts))
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"body": texts}), tmp_path / "pq" / "part.parquet")
    text = load_data(DataConfig(format="text", path=str(tmp_path / "txt"), tokenizer=user["tok"],
                                vocab_size=byo.VOCAB, cache_dir=tmp_path / "c"))
    table = load_data(DataConfig(format="parquet", path=str(tmp_path / "pq" / "*.parquet"),
                                 tokenizer=user["tok"], vocab_size=byo.VOCAB, text_field="body",
                                 cache_dir=tmp_path / "c"))
    # One document per paragraph either way: the same ids.
    assert np.array_equal(text.train, table.train) and np.array_equal(text.val, table.val)
    with pytest.raises(ValueError, match="data.text_field = 'text' is not a column"):
        load_data(DataConfig(format="parquet", path=str(tmp_path / "pq"), tokenizer=user["tok"],
                             vocab_size=byo.VOCAB, cache_dir=tmp_path / "c"))
    (tmp_path / "one.txt").write_text("A single short document.")
    with pytest.raises(ValueError, match="training and 0 held-out tokens"):
        load_data(DataConfig(format="text", path=str(tmp_path / "one.txt"), tokenizer=user["tok"],
                             vocab_size=byo.VOCAB, cache_dir=tmp_path / "c"))
    with pytest.raises(FileNotFoundError, match="no json files"):
        load_data(DataConfig(format="json", path=str(tmp_path / "txt"), tokenizer=user["tok"],
                             vocab_size=byo.VOCAB, cache_dir=tmp_path / "c"))


def test_pretokenised_bins_are_mapped_and_their_ids_checked(user, tmp_path):
    bins = byo.write_bins(tmp_path / "bins", user["ids"], 4000)
    cfg = DataConfig(format="tokens", path=str(bins), vocab_size=byo.VOCAB)
    data = load_data(cfg, validate=True)
    assert isinstance(data.train, np.memmap) and np.array_equal(data.val, user["ids"][-4000:])
    assert load_vocab(cfg) == {"<ids below>": byo.VOCAB}
    assert not save_tokenizer(cfg, None, tmp_path / "export")
    with_tok = cfg.model_copy(update={"tokenizer": user["tok"]})
    assert load_vocab(with_tok)["<|endoftext|>"] == 0
    bad = user["ids"].copy()
    bad[123] = byo.VOCAB + 7
    byo.write_bins(tmp_path / "bad", bad, 4000)
    with pytest.raises(ValueError, match=r"token id 519 at position 123 .*data.vocab_size = 512"):
        load_data(cfg.model_copy(update={"path": str(tmp_path / "bad")}), validate=True)
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "train.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="3 bytes, not a non-empty whole number of uint16"):
        load_data(cfg.model_copy(update={"path": str(tmp_path / "odd")}))
    (tmp_path / "odd" / "train.bin").write_bytes(b"\x01\x00")
    with pytest.raises(FileNotFoundError, match="val.bin is missing"):
        load_data(cfg.model_copy(update={"path": str(tmp_path / "odd")}))


def test_a_tokenizer_or_model_larger_than_the_run_vocabulary_is_refused_naming_both(user, tmp_path):
    with pytest.raises(ValueError, match=r"has 512 tokens, more than data.vocab_size = 300"):
        load_data(_json(user, tmp_path, vocab_size=300))
    byo.make_model(tmp_path / "m", "gpt2")
    with pytest.raises(ValueError, match=r"model.vocab_size = 1024 differs from the pretrained "
                                         r"model's vocab_size = 512"):
        build_model(ModelConfig(pretrained=tmp_path / "m", vocab_size=1024), seed=0)
    with pytest.raises(ValueError, match="no config.json"):
        build_model(ModelConfig(pretrained=tmp_path / "nowhere", vocab_size=512), seed=0)
    with pytest.raises(ValueError, match="model.vocab_size = 512 differs from data.vocab_size = 600"):
        RunConfig(model={"pretrained": str(tmp_path / "m"), "vocab_size": 512},
                  data={"vocab_size": 600})


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="needs data.tokenizer"):
        DataConfig(format="json", path="x")
    with pytest.raises(ValueError, match="needs data.path"):
        DataConfig(format="tokens")
    with pytest.raises(ValueError, match="data.path = 'x' needs a data.format other than bundled"):
        DataConfig(path="x")
    with pytest.raises(ValueError, match="use uint32"):
        DataConfig(format="tokens", path="x", vocab_size=70000)
    assert ModelConfig(pretrained="m").arch == "hf"
    with pytest.raises(ValueError, match="is for arch hf, not arch 'llama'"):
        ModelConfig(pretrained="m", arch="llama")
    with pytest.raises(ValueError, match="exclude each other"):
        ModelConfig(pretrained="m", hf_config={"model_type": "gpt2"})
    with pytest.raises(ValueError, match=r"model.hidden_size = 64: not used with model.pretrained"):
        ModelConfig(pretrained="m", hidden_size=64)  # review 14: silently ignored before


def test_unreadable_data_is_refused_naming_the_data_not_the_reader(user, tmp_path):
    """Review 14 F5: an empty JSON-lines file, a line that is not JSON and a tokenizer
    directory that does not exist each name data.path or data.tokenizer (datasets and the
    HF hub used to speak of StopIteration, ArrowInvalid and repo ids)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"a.jsonl is empty \(no documents\)"):
        load_data(_json(user, tmp_path / "c1", path=str(tmp_path / "empty")))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "a.jsonl").write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(ValueError, match=r"data.path = .*broken.* \(json\): cannot read the record"):
        load_data(_json(user, tmp_path / "c2", path=str(tmp_path / "broken")))
    with pytest.raises(ValueError, match=r"data.tokenizer = .*nowhere.*: no such directory on this host"):
        load_data(_json(user, tmp_path / "c3", tokenizer=tmp_path / "nowhere"))


def test_a_run_that_cannot_be_prepared_is_a_spec_error_and_launch_exits_2(user, tmp_path):
    """Review 14 F4: data or model errors found while preparing exit 2 with one line (they
    exited 1 with a traceback)."""
    import yaml

    from dips.spec import SpecError
    from dips.train.prepare import prepare

    bad = user["ids"].copy()
    bad[1234] = byo.VOCAB + 1
    bins = byo.write_bins(tmp_path / "bad", bad, 4000)
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg.update(model={**cfg["model"], "vocab_size": byo.VOCAB},
               data={"format": "tokens", "path": str(bins), "vocab_size": byo.VOCAB,
                     "num_chunks": 8})
    with pytest.raises(SpecError, match=r"the run cannot be prepared: .*token id 513 at position 1234"):
        prepare(RunConfig.model_validate(cfg), tmp_path / "state")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "dips.cli", "launch", "--config",
                           str(tmp_path / "run.yaml"), "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "dips launch: the run cannot be prepared" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("kind", sorted(byo.MODELS))
def test_a_pretrained_directory_is_version_0_with_its_blocks_as_layers(tmp_path, kind):
    saved = byo.make_model(tmp_path / kind, kind, seed=5)
    model = build_model(ModelConfig(pretrained=tmp_path / kind, vocab_size=byo.VOCAB), seed=9)
    mine, theirs = dict(model.named_parameters()), dict(saved.named_parameters())
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine)
    prefix = {"llama": "model.layers", "qwen3": "model.layers", "gpt2": "transformer.h",
              "gpt_neox": "gpt_neox.layers"}[kind]
    assert blocks_prefix(model) == prefix
    table = layer_table(model)
    blocks = [k for k, _, _ in table if k.startswith("layers.")]
    assert [k for k, _, _ in table] == ["embed", *blocks, "head"] and len(blocks) >= 2
    embed = dict((k, ns) for k, ns, _ in table)
    assert all(not n.startswith(prefix) for n in embed["embed"] + embed["head"])
    assert check_built(model, 64, followers=2) == table


def test_followers_without_init_start_from_the_pretrained_weights(tmp_path):
    from dips.node.follower import _initial_params
    from dips.spec import RunSpec

    saved = byo.make_model(tmp_path / "m", "gpt_neox", seed=4)
    cfg = RunConfig(model={"pretrained": str(tmp_path / "m"), "vocab_size": byo.VOCAB},
                    data={"vocab_size": byo.VOCAB})
    spec = RunSpec(config=cfg, cache_dir=tmp_path, layers=[], follower_layers=[[], []], init="x",
                   eval_loss_initial=1.0, train_tokens=1, val_tokens=1, params=1,
                   windows_per_chunk=1)
    names = [n for n, _ in saved.named_parameters()][:5]
    got = _initial_params(spec, names, None)
    assert all(torch.equal(got[n], dict(saved.named_parameters())[n]) for n in names)


RSS_PROBE = """
import gc, sys
from dips.spec import DataConfig, InnerConfig, ModelConfig
from dips.train.trainer import build_trainer
model = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, vocab_size=512, max_seq_len=64)

def status(key):  # bytes, from /proc/self/status (VmHWM: the peak since the last reset)
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024

for path in sys.argv[1:]:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the resident memory now: Linux >= 4.0
    data = DataConfig(format="tokens", path=path, vocab_size=512, num_chunks=64)
    trainer = build_trainer("a", model, data, InnerConfig(H=8, batch_size=4, seq_len=64), 0)
    trainer.batches.set_holdings([(0, 0), (31, 0), (63, 0)])
    for _ in range(12):
        trainer.step()
    print(len(trainer.batches.tokens), status("VmHWM"), status("VmRSS"), flush=True)
    del trainer
    gc.collect()
"""


def test_a_clusters_memory_does_not_grow_with_the_dataset(tmp_path):
    """The data path of a cluster process (build_trainer, the ledger's LeaseSampler, 12 inner
    steps from 3 leased chunks) over 4 M then 40 M tokens (8 and 80 MB) in one process, its
    peak RSS reset before each (so import-time peaks do not hide anything): the peak and the
    resident memory after training grow by less than 10 % of the 72 MB the dataset grew by
    (a stream held in RAM adds all of it)."""
    rng = np.random.default_rng(0)
    sizes = (4_000_000, 40_000_000)
    for n in sizes:
        folder = tmp_path / str(n)
        folder.mkdir()
        with open(folder / "train.bin", "wb") as f:
            for _ in range(0, n, 4_000_000):
                rng.integers(0, 512, 4_000_000, dtype=np.uint16).tofile(f)
        rng.integers(0, 512, 10_000, dtype=np.uint16).tofile(folder / "val.bin")
    proc = subprocess.Popen([sys.executable, "-c", RSS_PROBE, *(str(tmp_path / str(n)) for n in sizes)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        out, err = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err[-2000:]
    (small, peak_small, rss_small), (large, peak_large, rss_large) = (
        (int(x) for x in row.split()) for row in out.split("\n")[:2])
    assert (small, large) == sizes
    print(f"peak RSS {peak_small / 2**20:.1f} MiB over 4 M tokens, {peak_large / 2**20:.1f} MiB "
          f"over 40 M; resident after {rss_small / 2**20:.1f} and {rss_large / 2**20:.1f} MiB")
    assert peak_large - peak_small < 0.1 * 72_000_000
    assert rss_large - rss_small < 0.1 * 72_000_000


def test_the_data_digest_tells_copies_apart_and_names_both_figures():
    """token_digest (the run spec's data_digest) by hand: equal streams, equal digests; one id
    changed inside a sampled block, a shifted stream, another dtype or another held-out split
    each change it; check_run_data names this host's figure and the run's."""
    from dips.train.corpus import TokenData
    from dips.train.datasource import DIGEST_TOKENS, check_run_data, token_digest

    rng = np.random.default_rng(5)
    train = rng.integers(0, 500, 3_000_000, dtype=np.uint16)
    val = rng.integers(0, 500, 20_000, dtype=np.uint16)
    base = token_digest(TokenData(train, val, 512))
    assert len(base) == 64 and base == token_digest(TokenData(train.copy(), val.copy(), 512))
    one = train.copy()
    one[len(train) - 1] += 1  # in the last block, always sampled
    first = train.copy()
    first[DIGEST_TOKENS - 1] += 1  # in the first block
    for other in (TokenData(one, val, 512), TokenData(first, val, 512),
                  TokenData(np.roll(train, 1), val, 512),
                  TokenData(train.astype(np.uint32), val.astype(np.uint32), 512),
                  TokenData(train, val[::-1].copy(), 512)):
        assert token_digest(other) != base
    check_run_data(TokenData(train, val, 512), len(train), base, "cluster a")
    check_run_data(TokenData(train, val, 512), len(train), None, "cluster a")  # an older spec
    with pytest.raises(ValueError, match=r"cluster a: this host's data has 2999999 train tokens, "
                                         r"the run's 3000000"):
        check_run_data(TokenData(train[:-1], val, 512), len(train), base, "cluster a")
    with pytest.raises(ValueError, match=rf"cluster a: this host's data has digest "
                                         rf"{token_digest(TokenData(one, val, 512))[:16]}…, the "
                                         rf"run's {base[:16]}…"):
        check_run_data(TokenData(one, val, 512), len(train), base, "cluster a")


def test_run_json_records_the_sizes_of_the_model_it_loaded(user, tmp_path):
    """Issue 14: with ``model.pretrained`` run.json's ``model`` is the directory's model (its
    class, width, blocks, vocabulary, parameters), and ``config.model`` leaves out the
    built-in sizes it does not use, so no reader takes them for the model's; the leader's
    restart check still finds the same config. A built-in model's facts are its config's."""
    import json

    import yaml

    from dips.spec import RunSpec
    from dips.train.prepare import prepare

    saved = byo.make_model(tmp_path / "gpt2", "gpt2", seed=3)
    bins = byo.write_bins(tmp_path / "bins", user["ids"], 4000)
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    data = {"format": "tokens", "path": str(bins), "vocab_size": byo.VOCAB, "num_chunks": 8}
    cfg.update(model={"pretrained": str(tmp_path / "gpt2"), "vocab_size": byo.VOCAB}, data=data)
    run = RunConfig.model_validate(cfg)
    prepare(run, tmp_path / "state")
    doc = json.loads((tmp_path / "state" / "run.json").read_text())
    assert doc["model"] == {
        "architecture": "GPT2LMHeadModel", "model_type": "gpt2",
        "pretrained": str(tmp_path / "gpt2"), "hidden_size": 32, "num_layers": 2,
        "vocab_size": byo.VOCAB, "max_position_embeddings": 64,
        "params": sum(p.numel() for p in saved.parameters())}
    assert doc["params"] == doc["model"]["params"]
    assert set(doc["config"]["model"]) == {"arch", "pretrained", "hf_config", "layer_pattern",
                                           "vocab_size"}
    assert RunSpec.read(tmp_path / "state" / "run.json").config == run

    cfg["model"] = {**yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())["model"],
                    "vocab_size": byo.VOCAB, "hidden_size": 48, "num_layers": 3}
    prepare(RunConfig.model_validate(cfg), tmp_path / "built")
    spec = RunSpec.read(tmp_path / "built" / "run.json")
    assert (spec.model.architecture, spec.model.hidden_size, spec.model.num_layers) == \
        ("LlamaForCausalLM", 48, 3)
    assert spec.config.model.hidden_size == 48 and spec.model.params == spec.params


DIGEST_RSS = """
import os, re, sys
import numpy as np
from types import SimpleNamespace
from dips.train.datasource import token_digest
path = sys.argv[1]
fd = os.open(path, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: as on a host that just copied it
os.close(fd)
train = np.memmap(path, dtype=np.uint16, mode="r")
def rss_file():
    return int(re.search(r"RssFile:\\s+(\\d+)", open("/proc/self/status").read())[1]) * 1024
before = rss_file()
token_digest(SimpleNamespace(train=train, val=train[:4096]))  # no TokenData: it checks every id
print(rss_file() - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_the_digest_pages_in_what_it_samples_not_the_kernels_readahead(tmp_path):
    """Review 24, F3: the digest's 256 sampled blocks of 8 KiB paged in 448 MB of a 953 MB
    memmap on a host that reads ahead 8 MiB a fault (19 MB of it here); read without
    readahead they map about 3 MB (``madvise(MADV_RANDOM)`` while the digest reads)."""
    path = tmp_path / "train.bin"
    with open(path, "wb") as f:  # 128 MB, on disk: the kernel may then drop it from its cache
        np.arange(64 << 20, dtype=np.uint64).view(np.uint16)[: 64 << 20].tofile(f)
        f.flush()
        os.fsync(f.fileno())
    out = subprocess.run([sys.executable, "-c", DIGEST_RSS, str(path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    sampled = DIGEST_BLOCKS * DIGEST_TOKENS * 2
    assert int(out.stdout) <= 4 * sampled, f"{int(out.stdout) / 2**20:.1f} MB paged in"
