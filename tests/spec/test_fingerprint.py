"""dips.spec.fingerprint.mismatch on a member's fingerprint: bounded work, first error only
(review 21, F2: ``{"tensors":[0,0,...]}`` of 1 MiB made pydantic build 500,002 errors)."""

from __future__ import annotations

import json

import pytest

from dips.spec import fingerprint as fp
from dips.spec.fingerprint import Fingerprint, mismatch

RUN = Fingerprint(architecture={"model_type": "llama", "num_attention_heads": 4,
                                "rope_parameters": {"rope_theta": 10000.0}},
                  vocab_sha256="ab" * 32,
                  tensors=[("embed.weight", [64, 16], "float32"),
                           ("layers.0.w", [16, 16], "float32"),
                           ("head.weight", [64, 16], "float32")])
WANT = RUN.to_json()
#: The review's input: 500,000 entries of the wrong type, just under the 1 MiB field limit.
REVIEW_INPUT = '{"tensors":[' + ",".join(["0"] * 500_000) + "]}"


def doc(**change) -> str:
    d = json.loads(WANT)
    d.update(change)
    return json.dumps(d)


@pytest.fixture
def no_pydantic_on_member_input(monkeypatch):
    """Fails a test in which the member's document reaches pydantic (the run's may, once)."""
    real = Fingerprint.model_validate_json.__func__

    def guarded(cls, data, *a, **kw):
        assert data == WANT, f"pydantic parsed a member's document ({len(data)} characters)"
        return real(cls, data, *a, **kw)

    monkeypatch.setattr(Fingerprint, "model_validate_json", classmethod(guarded))
    fp._run_fingerprint.cache_clear()


def test_the_reviews_input_is_refused_by_its_length_without_a_parse(monkeypatch,
                                                                    no_pydantic_on_member_input):
    parsed: list[int] = []
    monkeypatch.setattr(fp.json, "loads", lambda s, *a, **k: parsed.append(len(s)))
    why = mismatch(WANT, REVIEW_INPUT)
    assert why.startswith("malformed fingerprint: 1000013 characters")
    assert parsed == []  # refused by its length: json never saw it


@pytest.mark.parametrize("got, first", [
    ('{"tensors":[' + ",".join(["0"] * 2000) + "]}", "object of architecture"),
    (doc(tensors=[0] * 1000), "tensors[0] is not a [name, shape, dtype] triple"),
    (doc(tensors=[["embed.weight", [64, True], "float32"]] * 3), "shape must be a list of int"),
    (doc(tensors=[["embed.weight", [64.0, 16], "float32"]]), "shape must be a list of int"),
    (doc(vocab_sha256=1), "vocab_sha256 a string"),
    (doc(extra=1), "object of architecture"),
    (doc(architecture={"rope_scaling": [[[[[[[[[1]]]]]]]]]}), "nested deeper than 8"),
    ("[" * 2000 + "]" * 2000, "not JSON (RecursionError)"),
    ('{"architecture": 1' + "0" * 5000 + "}", "not JSON (ValueError)"),  # > 4300 digits
])
def test_a_malformed_fingerprint_is_described_by_its_first_error(got, first,
                                                                 no_pydantic_on_member_input):
    why = mismatch(WANT, got)
    assert why.startswith("malformed fingerprint") and first in why, why
    assert len(why) < 300


def test_the_same_fingerprint_agrees_however_it_is_written(no_pydantic_on_member_input):
    assert mismatch(WANT, WANT) == ""
    assert mismatch(WANT, json.dumps(json.loads(WANT), indent=2)) == ""  # another layout


def test_another_model_is_named_by_its_differences(no_pydantic_on_member_input):
    other = RUN.model_copy(update={"architecture": {**RUN.architecture,
                                                    "num_attention_heads": 8},
                                   "tensors": RUN.tensors[:2]})
    why = mismatch(WANT, other.to_json())
    assert "architecture.num_attention_heads: run 4, cluster 8" in why
    assert "tensors: run 3, cluster 2" in why
    shape = RUN.model_copy(update={"tensors": [RUN.tensors[0], ("layers.0.w", [16, 32],
                                                                "float32"), RUN.tensors[2]]})
    assert "tensor #1: run layers.0.w [16, 16] float32, cluster 'layers.0.w' [16, 32]" in \
        mismatch(WANT, shape.to_json())
    assert mismatch(WANT, "") == "the join carries no model fingerprint"


def test_keys_that_differ_only_by_null_still_differ_elsewhere(no_pydantic_on_member_input):
    """Many extra keys sort before the real ones: every key is still compared."""
    arch = {f"a{i:04d}": None for i in range(50)} | {**RUN.architecture, "num_attention_heads": 2}
    why = mismatch(WANT, doc(architecture=arch))
    assert "num_attention_heads: run 4, cluster 2" in why


def test_a_model_up_to_growth_times_larger_is_still_described(no_pydantic_on_member_input):
    big = RUN.model_copy(update={"tensors": RUN.tensors * fp.GROWTH})
    assert "tensors: run 3, cluster 12" in mismatch(WANT, big.to_json())
