"""Prepare a run once, on the host that holds the leader's state: the tokenizer, the token
stream and its data chunks, version 0 of the model, the layer ownership, the fingerprint.

Written into a directory (the leader's state directory): ``run.json`` (a :class:`RunSpec`;
its ``model`` is the model as built or loaded, :func:`dips.train.model.model_facts`) and
``init/model.safetensors`` (version 0 of θ, for a follower started with ``--init`` on the
same host; followers elsewhere build the same θ from the config's seed, or load it from
``model.pretrained`` on their own host).  A user's text / JSON / Parquet data is tokenised here,
once, into the memmap cache (:mod:`dips.train.tokenize_files`); every id of the data is
checked against the model's vocabulary here (:func:`dips.train.datasource.load_data`).
"""

from __future__ import annotations

import os
from pathlib import Path

from dips.algo import partition_contiguous
from dips.spec import RunConfig, RunSpec, SpecError


def prepare(cfg: RunConfig, out: Path, cache_dir: Path | None = None) -> RunSpec:
    """Build the run spec of ``cfg`` into ``out`` (see the module docstring); returns it.

    ``cache_dir``: tokenizer/corpus cache (default ``cfg.data.cache_dir``, relative to the
    working directory). Takes seconds (tokenizer training is cached); a user's dataset takes
    one streaming pass to tokenise and one to check its ids.

    Raises:
        SpecError: the run cannot be prepared from this config on this host, one message
            naming the field or file: the data and the model disagree (vocabulary, a chunk
            shorter than one window), or what :func:`dips.train.datasource.load_data` and
            :func:`dips.train.model.build_model` refuse (ValueError), data or a model
            directory missing or unreadable (OSError). The role commands exit 2 on it.
    """
    try:
        return _prepare(cfg, out, cache_dir)
    except SpecError:
        raise
    except (ValueError, OSError) as exc:  # the user's data or model, checked here, not a bug
        raise SpecError(f"the run cannot be prepared: {exc}") from exc


def _prepare(cfg: RunConfig, out: Path, cache_dir: Path | None) -> RunSpec:
    import torch
    from safetensors.torch import save_file

    from dips.train.datasource import load_data, load_vocab, token_digest
    from dips.train.loop import eval_loss
    from dips.train.model import build_model, check_built, fingerprint_of, model_facts
    from dips.train.sampler import make_chunks

    cache = (cache_dir or cfg.data.cache_dir).resolve()
    vocab = load_vocab(cfg.data, cache)
    data = load_data(cfg.data, cache, validate=True)
    chunks = make_chunks(len(data.train), cfg.data.num_chunks)
    windows = min(e - s for s, e in chunks) // (cfg.inner.seq_len + 1)
    if windows < 1:
        raise ValueError(f"data.num_chunks = {cfg.data.num_chunks} cuts {len(data.train)} train "
                         f"tokens into chunks shorter than one window of inner.seq_len + 1 = "
                         f"{cfg.inner.seq_len + 1} tokens")
    model = build_model(cfg.model, cfg.seed)
    table = check_built(model, cfg.inner.seq_len, cfg.followers, cfg.model.layer_pattern)
    parts = partition_contiguous([nbytes for _, _, nbytes in table], cfg.followers)
    (out / "init").mkdir(parents=True, exist_ok=True)
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()},
              str(out / "init" / "model.safetensors"))
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    try:
        initial = eval_loss(model, data.val, cfg.inner.seq_len, cfg.eval_batch_size,
                            cfg.eval_batches)
    finally:
        torch.set_num_threads(threads)
    spec = RunSpec(
        config=cfg, cache_dir=cache,
        layers=[(l, list(names), int(nbytes)) for l, names, nbytes in table],
        follower_layers=[[table[i][0] for i in r] for r in parts],
        init="init/model.safetensors", eval_loss_initial=initial,
        train_tokens=int(len(data.train)), val_tokens=int(len(data.val)),
        data_digest=token_digest(data),
        params=int(sum(p.numel() for p in model.parameters())),
        model=model_facts(model, cfg.model, table),
        windows_per_chunk=windows, fingerprint=fingerprint_of(model, vocab))
    spec.write(out / "run.json")
    return spec
