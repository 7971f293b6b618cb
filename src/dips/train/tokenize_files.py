"""Tokenise a user's local text / JSON-lines / Parquet files once into a ``numpy.memmap`` cache.

Issue 14 (bring your own data); §12 of the seed: the data is prepared once, then cut into many
more chunks than clusters.  The files are read by HF ``datasets`` in streaming mode (one
record at a time, never the whole dataset in memory: ``load_dataset(builder,
data_files=..., streaming=True)``) and tokenised in batches with
``transformers.AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)``; the ids are
appended to ``train.bin`` / ``val.bin`` (flat arrays, uint16 when the vocabulary fits, else
uint32: the nanoGPT layout that :func:`dips.train.datasource.open_tokens` maps lazily).

Each document is followed by the tokenizer's end-of-sequence id. Held-out split: a running
credit of ``val_fraction`` × the tokens seen decides; once it covers a whole document, that
document goes to ``val`` (short documents: JSON lines, paragraphs); once it reaches
:data:`MIN_TAIL` tokens inside a longer document, that document's tail does (one book per
file, as the bundled corpora are split). So ``val`` is about ``val_fraction`` of the tokens,
never a scatter of one-token fragments, and the rest goes to ``train``.  The result depends only on the files, the
tokenizer and the config, so every host that tokenises the same files gets the same bytes.

The cache folder is ``cache_dir/datasets/<key>/`` with ``key`` a hash of the format, the files
(paths and sizes), the column, the tokenizer's files and ``val_fraction``; ``meta.json`` is
written last (atomically), so a folder without it is incomplete and is redone.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dips.spec import DataConfig

__all__ = ["EXTENSIONS", "MIN_TAIL", "cache_folder", "data_files", "load_tokenizer_dir", "token_dtype",
           "tokenize_to_cache"]

log = logging.getLogger(__name__)

#: File name endings taken from a ``data.path`` directory, per format.
EXTENSIONS = {"text": (".txt", ".text", ".md"), "json": (".json", ".jsonl"),
              "parquet": (".parquet",)}

#: Fewest tokens of a document's tail held out (shorter credit waits for a whole document).
MIN_TAIL = 32

#: Documents tokenised per batch (bounds the memory of one batch, not of the dataset).
BATCH_DOCS = 256


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id of ``vocab_size`` fits (≤ 65536 ids), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def data_files(data: DataConfig) -> list[Path]:
    """The files of ``data.path``: the file itself, a directory's files of the format (sorted,
    recursive), or a glob pattern's matches (sorted). Raises FileNotFoundError naming
    ``data.path`` when there are none."""
    path = Path(str(data.path)).expanduser()
    if path.is_file():
        return [path.resolve()]
    if path.is_dir():
        found = sorted(p for p in path.rglob("*")
                       if p.is_file() and p.name.endswith(EXTENSIONS[data.format]))
    else:
        found = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    if not found:
        raise FileNotFoundError(f"data.path = {data.path!r}: no {data.format} files "
                                f"({', '.join(EXTENSIONS[data.format])}) on this host")
    return [p.resolve() for p in found]


def load_tokenizer_dir(path: Path, vocab_size: int):
    """``AutoTokenizer.from_pretrained(path, local_files_only=True)``, checked: its ids must
    be below ``vocab_size`` (the model's vocabulary). Raises ValueError naming both values,
    or the directory when it cannot be loaded."""
    from transformers import AutoTokenizer  # heavy import (seconds), deferred

    if not Path(path).expanduser().is_dir():  # else HF reads it as a hub repo id
        raise ValueError(f"data.tokenizer = {str(path)!r}: no such directory on this host")
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"data.tokenizer = {str(path)!r}: {exc}") from None
    if len(tok) > vocab_size:
        raise ValueError(f"the tokenizer at data.tokenizer = {str(path)!r} has {len(tok)} tokens, "
                         f"more than data.vocab_size = {vocab_size} (the model's vocabulary)")
    return tok


def _tokenizer_digest(path: Path) -> str:
    """SHA-256 over the tokenizer directory's files (names and bytes; they are small)."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        h.update(f.relative_to(path).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def cache_folder(data: DataConfig, cache_dir: Path) -> Path:
    """``cache_dir/datasets/<key>`` for ``data`` (module docstring). Raises what
    :func:`data_files` raises."""
    files = data_files(data)
    doc = {"format": data.format, "files": [(str(f), f.stat().st_size) for f in files],
           "text_field": data.text_field, "sample_by": data.sample_by,
           "tokenizer": _tokenizer_digest(Path(str(data.tokenizer))),
           "val_fraction": data.val_fraction, "vocab_size": data.vocab_size}
    key = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:20]
    return Path(cache_dir) / "datasets" / key


def _documents(data: DataConfig, files: list[Path], hf_cache: Path) -> Iterator[str]:
    """The documents' texts, streamed by HF ``datasets`` (no Arrow cache is written; its lock
    files go to ``hf_cache``, inside dips' cache rather than the user's home)."""
    import datasets  # heavy import, deferred

    datasets.disable_progress_bars()
    for f in files:
        if f.stat().st_size == 0:
            raise ValueError(f"data.path = {data.path!r}: {f} is empty (no documents)")
    options = {"sample_by": data.sample_by} if data.format == "text" else {}
    stream = datasets.load_dataset(data.format, data_files=[str(f) for f in files],
                                   split="train", streaming=True, cache_dir=str(hf_cache),
                                   **options)
    column = "text" if data.format == "text" else data.text_field
    records = iter(stream)
    for i in itertools.count():
        try:
            record = next(records)
        except StopIteration:
            return
        except Exception as exc:  # datasets / pyarrow internals: name the user's data instead
            raise ValueError(f"data.path = {data.path!r} ({data.format}): cannot read the "
                             f"record after {i} records: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
        if column not in record:
            raise ValueError(f"data.text_field = {column!r} is not a column of {data.path!r} "
                             f"(record {i} has {sorted(record)})")
        text = record[column]
        if isinstance(text, str) and text.strip():
            yield text


def _batches(docs: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def tokenize_to_cache(data: DataConfig, cache_dir: Path) -> Path:
    """Tokenise ``data`` (format text, json or parquet) into its cache folder unless it is
    complete already; returns the folder (``train.bin``, ``val.bin``, ``meta.json``).

    ``meta.json``: ``{"dtype", "train_tokens", "val_tokens", "documents", "eot_id",
    "tokenizer_tokens", "files"}`` (token counts in tokens). Memory: one batch of
    :data:`BATCH_DOCS` documents, whatever the dataset's size. Concurrent callers write
    unique temporary files and ``os.replace`` them (identical contents).

    Raises:
        FileNotFoundError: no files at ``data.path``; ValueError: the tokenizer cannot be
            loaded, has more tokens than ``data.vocab_size`` or no end-of-sequence token, the
            column is missing, or no training or no held-out token results.
    """
    folder = cache_folder(data, cache_dir)
    if (folder / "meta.json").is_file():
        return folder
    files = data_files(data)
    tok = load_tokenizer_dir(Path(str(data.tokenizer)), data.vocab_size)
    eot = tok.eos_token_id
    if eot is None:
        raise ValueError(f"the tokenizer at data.tokenizer = {str(data.tokenizer)!r} has no "
                         "eos_token to end each document")
    tok.model_max_length = 2**62  # documents are cut into windows later, never truncated
    dtype = token_dtype(data.vocab_size)
    folder.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}.{uuid.uuid4().hex}"
    tmp = {name: folder / f".{name}.{tag}.tmp" for name in ("train.bin", "val.bin", "meta.json")}
    counts = {"train.bin": 0, "val.bin": 0}
    carry, documents = 0.0, 0
    log.info("tokenising %d %s files of %s into %s", len(files), data.format, data.path, folder)
    try:
        with open(tmp["train.bin"], "wb") as train, open(tmp["val.bin"], "wb") as val:
            docs = _documents(data, files, Path(cache_dir) / "hf-datasets")
            for batch in _batches(docs, BATCH_DOCS):
                for ids in tok(batch, add_special_tokens=False)["input_ids"]:
                    n = len(ids)
                    carry += n * data.val_fraction
                    if carry >= n:
                        held = n  # a short document, held out whole
                    elif carry >= MIN_TAIL:
                        held = int(carry)  # a long document's tail
                    else:
                        held = 0
                    carry -= held
                    for out, part, name in ((train, ids[:n - held], "train.bin"),
                                            (val, ids[n - held:], "val.bin")):
                        if part:
                            np.asarray([*part, eot], dtype=dtype).tofile(out)
                            counts[name] += len(part) + 1
                    documents += 1
        if counts["train.bin"] == 0 or counts["val.bin"] == 0:
            raise ValueError(f"data.path = {data.path!r}: {counts['train.bin']} training and "
                             f"{counts['val.bin']} held-out tokens (data.val_fraction = "
                             f"{data.val_fraction}): both must be non-empty")
        meta = {"dtype": dtype.name, "train_tokens": counts["train.bin"],
                "val_tokens": counts["val.bin"], "documents": documents, "eot_id": int(eot),
                "tokenizer_tokens": len(tok), "files": [str(f) for f in files]}
        tmp["meta.json"].write_text(json.dumps(meta, indent=1))
        os.replace(tmp["train.bin"], folder / "train.bin")
        os.replace(tmp["val.bin"], folder / "val.bin")
        os.replace(tmp["meta.json"], folder / "meta.json")  # last: marks the folder complete
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    log.info("tokenised %d documents: %d train, %d held-out tokens", documents,
             counts["train.bin"], counts["val.bin"])
    return folder
