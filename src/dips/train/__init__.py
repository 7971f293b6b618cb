"""Training-side layer of dips: corpus and tokenizer, model builders, the inner AdamW loop.

Modules (import them directly; this package imports nothing so that ``import dips.train`` stays
cheap — ``transformers`` costs 5–9 s per process and is loaded only by :mod:`dips.train.model`):

* :mod:`dips.train.corpus` — offline corpus (Shakespeare + KJV Bible), byte-level BPE tokenizer,
  cached token streams, and (re-exported from :mod:`dips.train.sampler`) data chunks (§12) and
  the per-cluster :class:`~dips.train.sampler.BatchSampler`.
* :mod:`dips.train.model` — scaled-down LLaMA / Qwen3 models (§13) and the per-layer table.
* :mod:`dips.train.loop` — AdamW inner steps and the deterministic validation loss.
* :mod:`dips.train.trainer` — one cluster's trainer (model, inner AdamW, batches, counters),
  built from the typed spec by :func:`~dips.train.trainer.build_trainer` for every method.
* :mod:`dips.train.run` — the one real-time training loop, with the synchronisation plugged in.
* :mod:`dips.train.dips_sync` — Di-PS as that loop's sync (the cluster client, §5–§6).
"""
