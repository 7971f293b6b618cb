"""The evaluator's log line of an accepted held-out record (review 28 of issue 15, #7: its
perplexity was printed unrounded, ``97.17532941852915``, beside a loss to 4 decimals)."""

from __future__ import annotations

from dips.node.evaluate import eval_line


def test_the_perplexity_is_rounded_and_an_overflow_or_unknown_count_said_in_words():
    rec = {"version": 36, "eval_loss": 4.57653, "perplexity": 97.17532941852915,
           "tokens_accepted": 174080}
    assert eval_line(rec) == ("version 36: held-out loss 4.5765 nats/token (perplexity 97.18), "
                              "174,080 tokens accepted")
    rec.update(perplexity=None, tokens_accepted=None, eval_loss=11719.0)
    assert eval_line(rec) == ("version 36: held-out loss 11719.0000 nats/token (perplexity "
                              "overflow), unknown tokens accepted")
