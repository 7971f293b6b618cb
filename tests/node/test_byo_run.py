"""Bring your own model and data (issue 14), end to end with real role processes (a leader,
followers, one cluster; 127.0.0.1, no security): the user's directories are made by the
test the way a user makes them (``save_pretrained`` of a model trained a little, a tokenizer
saved with ``save_pretrained``, JSON-lines files, nanoGPT ``train.bin``/``val.bin``).

1. ``model: {pretrained: DIR}`` + ``data: {format: json, ...}``: the leader tokenises the files
   once into its memmap cache and checks every id; the followers (no ``--init``) load version
   0 from the directory themselves; the cluster (its own cache, as on another host) rebuilds
   the same memmap; its first inner step, on the model it pulled at its join, already has the
   pretrained model's loss, far below a fresh initialisation's ln(V).
2. ``data: {format: tokens, ...}``: a pre-tokenised memmap drives a GPT-NeoX of an HF config
   (one follower); the cluster's peak RSS (``wait4``) is reported and bounded."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from dips.emu.launcher import free_port
from tests.train import byo

from .roles import ROOT, follower_args, kill_left, stop_cleanly
from .roles import dips as _dips

pytestmark = [pytest.mark.timeout(240), pytest.mark.integration]


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """The user's directories: tok/, data/ (JSONL), bins/ (train.bin, val.bin), model/
    (a LLaMA trained 30 AdamW steps on the same text)."""
    root = tmp_path_factory.mktemp("user")
    texts = byo.paragraphs(200_000)
    tok = byo.make_tokenizer(root / "tok", texts)
    ids = byo.encode(tok, texts)
    byo.make_model(root / "model", "llama", ids, steps=30)
    return {"tok": tok, "data": byo.make_jsonl(root / "data", texts),
            "bins": byo.write_bins(root / "bins", ids, 4000), "model": root / "model"}


def _config(tmp: Path, model: dict, data: dict, followers: int) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg.update(model=model, data={"vocab_size": byo.VOCAB, "num_chunks": 24, **data},
               clusters=[{"id": "a"}], max_time_s=None, max_outer_steps=2, followers=followers)
    (tmp / "run.yaml").write_text(yaml.safe_dump(cfg))
    return tmp / "run.yaml"


def _lines(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] \
        if path.exists() else []


def _run(tmp: Path, cfg: Path, followers: int) -> tuple[dict, int]:
    """Leader, ``followers`` followers (no --init) and cluster ``a`` (its own cache dir) until
    the run finishes; returns the processes (stopped) and the cluster's peak RSS (bytes)."""
    leader = f"127.0.0.1:{free_port()}"
    procs = {"leader": _dips(["leader", "--config", str(cfg), "--listen", leader, "--state-dir",
                             str(tmp / "leader"), "--cache-dir", str(tmp / "leader-cache"),
                             "--insecure"], tmp / "leader.log")}
    try:
        for i in range(followers):
            procs[f"f{i}"] = _dips(follower_args(leader, i, tmp / f"f{i}"), tmp / f"f{i}.log")
        procs["a"] = _dips(["cluster", "--leader", leader, "--cluster-id", "a", "--state-dir",
                           str(tmp / "a"), "--cache-dir", str(tmp / "a-cache"), "--insecure"],
                          tmp / "a.log")
        rc, peak = _wait_rusage(procs["a"], procs, 200.0)
        assert rc == 0, (tmp / "a.log").read_text()[-3000:]
        stop_cleanly(procs, (*(f"f{i}" for i in range(followers)), "leader"))
        return procs, peak
    finally:
        kill_left(procs)


def _wait_rusage(proc, procs: dict, limit_s: float) -> tuple[int, int]:
    """Reap ``proc`` (an event: its exit) with ``os.wait4``: (exit status, its peak RSS in
    bytes). Fails early if another process of ``procs`` exits or after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_maxrss * 1024
        dead = {n: p.returncode for n, p in procs.items() if p is not proc and p.poll() is not None}
        assert not dead and time.monotonic() < deadline, f"waiting for the cluster: exited {dead}"
        time.sleep(0.2)


def test_a_pretrained_model_and_jsonl_files_drive_a_run(user, tmp_path):
    from dips.spec import RunSpec
    from dips.train.datasource import load_data
    from dips.train.loop import eval_loss
    from dips.train.model import build_model

    cfg = _config(tmp_path, {"pretrained": str(user["model"]), "vocab_size": byo.VOCAB},
                  {"format": "json", "path": str(user["data"]), "tokenizer": str(user["tok"])}, 2)
    _run(tmp_path, cfg, 2)
    decisions = [d for d in _lines(tmp_path / "leader" / "outer_steps.jsonl") if "accepted" in d]
    assert len(decisions) >= 2 and all(d["accepted"] == ["a"] for d in decisions)
    # One tokenisation per host, the same bytes on both.
    leader_bins = list((tmp_path / "leader-cache" / "datasets").glob("*/train.bin"))
    cluster_bins = list((tmp_path / "a-cache" / "datasets").glob("*/train.bin"))
    assert len(leader_bins) == len(cluster_bins) == 1
    assert leader_bins[0].read_bytes() == cluster_bins[0].read_bytes()
    # Version 0 is the pretrained model: the leader evaluated it, the cluster trained from it.
    spec = RunSpec.read(tmp_path / "leader" / "run.json")
    run = spec.config
    model = build_model(run.model, seed=0)
    val = load_data(run.data, tmp_path / "leader-cache").val
    assert spec.eval_loss_initial == pytest.approx(
        eval_loss(model, val, run.inner.seq_len, run.eval_batch_size, run.eval_batches), rel=1e-5)
    steps = [r for r in _lines(tmp_path / "a" / "train.jsonl") if "step" in r]
    assert steps[0]["loss"] < math.log(byo.VOCAB) - 0.8  # a fresh model: ln(V) = 6.24
    assert spec.fingerprint.architecture["model_type"] == "llama"


@pytest.mark.long  # make test-long (the memmap path: tests/train/test_byo_data.py)
def test_a_pretokenised_memmap_drives_a_run_in_bounded_memory(user, tmp_path):
    model = {"arch": "hf", "vocab_size": byo.VOCAB, "hf_config": byo.MODELS["gpt_neox"]}
    cfg = _config(tmp_path, model, {"format": "tokens", "path": str(user["bins"])}, 1)
    _, peak = _run(tmp_path, cfg, 1)
    decisions = [d for d in _lines(tmp_path / "leader" / "outer_steps.jsonl") if "accepted" in d]
    assert len(decisions) >= 2 and all(d["accepted"] == ["a"] for d in decisions)
    steps = [r for r in _lines(tmp_path / "a" / "train.jsonl") if "step" in r]
    assert len(steps) >= 16 and all(math.isfinite(r["loss"]) for r in steps)
    train = np.memmap(user["bins"] / "train.bin", dtype=np.uint16, mode="r")
    assert json.loads((tmp_path / "leader" / "run.json").read_text())["train_tokens"] == len(train)
    print(f"cluster peak RSS {peak / 2**20:.1f} MiB on {train.nbytes / 2**20:.2f} MiB of tokens")
    assert peak < 1 << 30  # torch + transformers + a tiny model; the data adds ~nothing


def test_a_cluster_whose_copy_of_the_data_differs_is_refused_at_start(user, tmp_path):
    """Hosts share no filesystem: each reads ``data.path`` from its own disk. After the leader
    prepared the run (its run spec records the streams' length and digest), the cluster's copy
    of ``train.bin`` is changed: other ids of the same length, then a shorter file. Each time
    the cluster refuses to start (exit 2), naming the digest or the lengths, before it joins."""
    bins = tmp_path / "bins"
    bins.mkdir()
    for name in ("train.bin", "val.bin"):
        (bins / name).write_bytes((user["bins"] / name).read_bytes())
    model = {"arch": "hf", "vocab_size": byo.VOCAB, "hf_config": byo.MODELS["gpt_neox"]}
    cfg = _config(tmp_path, model, {"format": "tokens", "path": str(bins)}, 1)
    leader = f"127.0.0.1:{free_port()}"
    procs = {"leader": _dips(["leader", "--config", str(cfg), "--listen", leader, "--state-dir",
                             str(tmp_path / "leader"), "--insecure"], tmp_path / "leader.log")}
    try:
        deadline = time.monotonic() + 150
        while not (tmp_path / "leader" / "run.json").exists():  # the event: the run prepared
            assert procs["leader"].poll() is None, (tmp_path / "leader.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the leader never prepared the run"
            time.sleep(0.2)
        train = np.fromfile(bins / "train.bin", dtype=np.uint16)
        for changed, words in ((train[::-1], "digest"), (train[:-1000], "train tokens")):
            changed.tofile(bins / "train.bin")
            log = tmp_path / f"a-{words.replace(' ', '-')}.log"
            procs["a"] = _dips(["cluster", "--leader", leader, "--cluster-id", "a",
                                "--state-dir", str(tmp_path / "a"), "--insecure"], log)
            assert procs["a"].wait(120) == 2, log.read_text()[-2000:]
            text = log.read_text()
            assert "cluster a: this host's data has" in text and words in text, text[-2000:]
            assert "Traceback" not in text
        assert procs["leader"].poll() is None  # the leader keeps serving
    finally:
        kill_left(procs)
