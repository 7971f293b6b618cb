"""Where a run's tokens come from: the bundled corpora or the user's own data (issue 14).

:func:`load_data` is the one entry point every process uses (the preparing leader, the
clusters, the evaluators) to get a :class:`~dips.train.corpus.TokenData` for a
:class:`~dips.spec.DataConfig`:

* ``format: bundled`` — :func:`dips.train.corpus.load_tokens` (the demo default; the whole
  stream, 2.8 M tokens, in memory);
* ``format: tokens`` — the user's pre-tokenised ``train.bin`` / ``val.bin`` (nanoGPT layout:
  flat ``uint16``/``uint32`` ids, no header), mapped read-only with ``numpy.memmap``;
* ``format: text | json | parquet`` — tokenised once into the memmap cache of
  :mod:`dips.train.tokenize_files` (by the preparing leader: :func:`dips.train.prepare.prepare`;
  a host without the cache tokenises the same files itself, streaming), then mapped likewise.

A mapped stream is read lazily: a cluster touches only the windows of the chunks it leases
(:class:`dips.train.lease.LeaseSampler`), so its memory does not grow with the dataset.  Only
the preparing host reads every id once (:func:`check_ids`, in blocks through a small buffer,
not through the map) to refuse ids outside the model's vocabulary.  Source: §12 of the seed
(many more chunks than clusters, served by the ledger); nanoGPT's ``train.bin`` layout.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
from pathlib import Path
from typing import Iterator

import numpy as np

from dips.spec import DataConfig
from dips.train.corpus import TokenData
from dips.train.tokenize_files import load_tokenizer_dir, tokenize_to_cache

__all__ = ["BLOCK_TOKENS", "DIGEST_BLOCKS", "DIGEST_TOKENS", "check_ids", "check_run_data",
           "load_data", "load_vocab", "open_tokens", "save_tokenizer", "token_digest"]

#: Ids read per block by :func:`check_ids` (8 MiB of uint16).
BLOCK_TOKENS = 1 << 22
#: Blocks of each stream :func:`token_digest` reads, and ids per block: at most 2 × 257 × 4,096
#: ids (4 MiB of uint32), so a host checks its copy of a terabyte of tokens in milliseconds.
DIGEST_BLOCKS, DIGEST_TOKENS = 256, 4096


def _mapped(path: Path, dtype: np.dtype, what: str) -> np.memmap:
    """``path`` mapped read-only as a flat array of ``dtype``. Raises FileNotFoundError or
    ValueError naming the file."""
    if not path.is_file():
        raise FileNotFoundError(f"{what}: {path} is missing on this host")
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise ValueError(f"{what}: {path} has {size} bytes, not a non-empty whole number of "
                         f"{dtype.name} ids")
    return np.memmap(path, dtype=dtype, mode="r")


def open_tokens(folder: Path, dtype: np.dtype | str, vocab_size: int,
                max_train_tokens: int | None = None, what: str = "data.path") -> TokenData:
    """``folder/train.bin`` and ``folder/val.bin`` as read-only ``numpy.memmap`` arrays of
    ``dtype`` (1-D ids; no byte is read until a window is), the train stream cut to
    ``max_train_tokens`` (a view). ``vocab_size``: the run's vocabulary (tokens).

    Raises:
        FileNotFoundError: a file missing; ValueError: an empty file or a size that is not a
            multiple of the id size (both name the file and ``what``).
    """
    dtype = np.dtype(dtype)
    folder = Path(folder)
    train = _mapped(folder / "train.bin", dtype, what)
    val = _mapped(folder / "val.bin", dtype, what)
    if max_train_tokens is not None:
        train = train[:max_train_tokens]
    return TokenData(train=train, val=val, vocab_size=vocab_size)


def check_ids(path: Path, dtype: np.dtype | str, count: int, vocab_size: int, what: str) -> None:
    """Raise ValueError (naming ``what``, the id and ``vocab_size``) if one of the first
    ``count`` ids of the file ``path`` (flat ``dtype``) is ``>= vocab_size``. Read block by
    block (:data:`BLOCK_TOKENS` ids) with ``np.fromfile``, so the file is never mapped or held
    whole in this process."""
    dtype = np.dtype(dtype)
    for start in range(0, count, BLOCK_TOKENS):
        block = np.fromfile(path, dtype=dtype, count=min(BLOCK_TOKENS, count - start),
                            offset=start * dtype.itemsize)
        bad = np.flatnonzero(block >= vocab_size)
        if bad.size:
            at = start + int(bad[0])
            raise ValueError(f"{what} holds token id {int(block[bad[0]])} at position {at} (the "
                             f"first of {bad.size} in ids {start}–{start + len(block) - 1}), not "
                             f"below data.vocab_size = {vocab_size} (the model's vocabulary)")


def token_digest(data: TokenData) -> str:
    """A SHA-256 (hex, 64 characters) of the streams' dtype and lengths and of
    :data:`DIGEST_BLOCKS` evenly spaced blocks of :data:`DIGEST_TOKENS` ids of each stream,
    its last block included. The preparing leader records it in the run spec
    (``RunSpec.data_digest``) and every process that trains or evaluates compares its own copy
    (:func:`check_run_data`): hosts share no filesystem, and a copy of other files (or another
    tokenizer) of the same length would otherwise train silently on other data. A sample,
    not every id: it reads a few MiB whatever the dataset's size, and catches another file,
    another tokenisation or a shifted stream, not one changed id between blocks."""
    h = hashlib.sha256()
    for name, part in (("train", data.train), ("val", data.val)):
        n = len(part)
        h.update(f"{name}:{part.dtype.str}:{n};".encode())
        if n == 0:
            continue
        last = max(0, n - DIGEST_TOKENS)
        with _no_readahead(part):
            for start in sorted({*np.linspace(0, last, DIGEST_BLOCKS, dtype=np.int64).tolist(),
                                 last}):
                h.update(np.ascontiguousarray(part[start:start + DIGEST_TOKENS])
                         .astype("<u4").tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def _no_readahead(part: np.ndarray) -> Iterator[None]:
    """While inside, the kernel reads only the pages ``part``'s sampled blocks touch when it
    is a memory-mapped file (``madvise(MADV_RANDOM)``, back to MADV_NORMAL after): its
    readahead (8 MiB a fault on a host measured in review 24, F3) made the digest's 256 small
    reads page in 448 MB of a 953 MB file. Nothing for an array in memory."""
    base = part
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
    if not isinstance(base, mmap.mmap) or not hasattr(mmap, "MADV_RANDOM"):
        yield
        return
    base.madvise(mmap.MADV_RANDOM)
    try:
        yield
    finally:
        base.madvise(mmap.MADV_NORMAL)


def check_run_data(data: TokenData, train_tokens: int, digest: str | None, what: str) -> None:
    """Raise ValueError (naming ``what``, this host's figure and the run's) unless ``data``
    has the run's ``train_tokens`` and, when the run recorded one, its ``digest``
    (:func:`token_digest`). ``what``: who checks (e.g. ``"cluster a"``)."""
    if len(data.train) != train_tokens:
        raise ValueError(f"{what}: this host's data has {len(data.train)} train tokens, the "
                         f"run's {train_tokens} (data.path or data.tokenizer differ from the "
                         "leader's)")
    if digest is not None and (mine := token_digest(data)) != digest:
        raise ValueError(f"{what}: this host's data has digest {mine[:16]}…, the run's "
                         f"{digest[:16]}… (same length, other tokens: data.path or "
                         "data.tokenizer differ from the leader's)")


def load_data(data: DataConfig, cache_dir: Path | None = None, *,
              validate: bool = False) -> TokenData:
    """The run's token streams for ``data`` (module docstring); ``cache_dir`` defaults to
    ``data.cache_dir``. ``validate`` (the preparing host): read every id once and refuse one
    outside ``data.vocab_size`` (:func:`check_ids`).

    Raises:
        FileNotFoundError: the data, its files or the bundled corpora missing on this host;
            ValueError: a malformed file, a tokenizer that does not fit ``data.vocab_size``,
            ids outside it, or too few tokens.
    """
    cache = Path(cache_dir if cache_dir is not None else data.cache_dir)
    if data.format == "bundled":
        from dips.train.corpus import load_tokens

        return load_tokens(cache, data.vocab_size, data.val_fraction, data.max_train_tokens)
    if data.format == "tokens":
        if data.tokenizer is not None:
            load_tokenizer_dir(data.tokenizer, data.vocab_size)  # its ids must fit too
        folder, dtype, what = Path(str(data.path)).expanduser(), data.token_dtype, "data.path"
    else:
        folder = tokenize_to_cache(data, cache)
        dtype = json.loads((folder / "meta.json").read_text())["dtype"]
        what = f"the token cache of data.path ({folder})"
    out = open_tokens(folder, dtype, data.vocab_size, data.max_train_tokens, what)
    if validate:
        for name, part in (("train.bin", out.train), ("val.bin", out.val)):
            check_ids(folder / name, dtype, len(part), data.vocab_size, f"{what}/{name}")
    return out


def load_vocab(data: DataConfig, cache_dir: Path | None = None) -> dict[str, int]:
    """The tokenizer vocabulary (token -> id) that goes into the model fingerprint
    (:func:`dips.train.model.fingerprint_of`): the bundled BPE's, the ``data.tokenizer``
    directory's, or, for pre-tokenised ids without a tokenizer, ``{"<ids below>":
    vocab_size}`` (only the vocabulary's size is known). Raises as :func:`load_data`."""
    if data.format == "bundled":
        from dips.train.corpus import load_tokenizer

        cache = Path(cache_dir if cache_dir is not None else data.cache_dir)
        return load_tokenizer(cache, data.vocab_size).get_vocab()
    if data.tokenizer is None:
        return {"<ids below>": data.vocab_size}
    return dict(load_tokenizer_dir(data.tokenizer, data.vocab_size).get_vocab())


def save_tokenizer(data: DataConfig, cache_dir: Path | None, out_dir: Path) -> bool:
    """Save the run's tokenizer next to an exported model (``save_pretrained`` files in
    ``out_dir``); returns False when there is none (pre-tokenised ids without
    ``data.tokenizer``). Raises as :func:`load_data`."""
    if data.format == "bundled":
        from dips.train.corpus import load_tokenizer, to_hf_tokenizer

        cache = Path(cache_dir if cache_dir is not None else data.cache_dir)
        to_hf_tokenizer(load_tokenizer(cache, data.vocab_size)).save_pretrained(out_dir)
        return True
    if data.tokenizer is None:
        return False
    load_tokenizer_dir(data.tokenizer, data.vocab_size).save_pretrained(out_dir)
    return True

