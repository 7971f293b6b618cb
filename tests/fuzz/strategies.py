"""Hypothesis strategies for hostile data-plane input (issue 13): JSON values a member could
put in any header field, headers that mix valid and hostile fields, tensor entries, and a
settings profile for slow, shared CI machines (no deadline, no example database)."""

from __future__ import annotations

import hmac
import json

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from tests.fuzz.hostile import LAYERS, SHAPES, pid, ticket

#: Every fuzz test: no deadline (CI is slow and shared), no database written into the tree.
FUZZ = settings(deadline=None, database=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


def fuzz(examples: int) -> settings:
    """:data:`FUZZ` with ``examples`` examples (kept modest, tens per test: tests/fuzz runs in
    well under a minute on two loaded cores; the long, coverage-guided fuzzing of the same
    decoders is `make fuzz`). A branch the random draws could miss is pinned by an
    ``@example``."""
    return settings(FUZZ, max_examples=examples)

_ABSENT = object()

INTS = st.one_of(st.integers(-3, 3), st.integers(-2**64, 2**64),
                 st.sampled_from([2**63 - 1, 2**63, -2**63 - 1, 10**400]))
LEAVES = st.one_of(st.none(), st.booleans(), INTS, st.floats(allow_nan=True),
                   st.text(max_size=20), st.sampled_from(["a", "b", "push", "pull", "bf16", "fp32"]))
JSON = st.recursive(LEAVES, lambda c: st.lists(c, max_size=4)
                    | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12)


def dumps(value) -> bytes:
    """JSON bytes of ``value`` (NaN and huge ints included, as Python's json writes them)."""
    return json.dumps(value).encode()


def either(valid):
    """The valid value, a hostile JSON value, or the field absent."""
    return st.one_of(st.just(valid), JSON, st.just(_ABSENT))


def shape_list():
    return st.one_of(st.lists(st.integers(0, 2**40), max_size=4),
                     st.lists(st.integers(0, 50), max_size=3),
                     st.sampled_from([list(s) for s in SHAPES.values()]), JSON)


def _present(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not _ABSENT}


TENSOR_ENTRY = st.one_of(
    st.fixed_dictionaries({"name": either("a.w"), "dtype": either("bf16"),
                           "shape": shape_list()}).map(_present),
    st.fixed_dictionaries({"name": st.sampled_from(list(SHAPES)),
                           "dtype": st.sampled_from(["bf16", "fp32"]),
                           "shape": st.sampled_from([list(s) for s in SHAPES.values()])}),
    JSON)


@st.composite
def push_headers(draw) -> dict:
    """A push header whose fields are each valid (with the leader's ticket for cluster a, push
    pid(1), round 1 or sent ahead), hostile, or absent."""
    stage = draw(st.booleans())
    valid = {"op": "push", "cluster": "a", "round": 0 if stage else 1,
             "layer": draw(st.sampled_from(list(LAYERS))), "push_id": pid(1), "tokens": 100,
             "stage": stage, **ticket("a", 0 if stage else 1, pid(1))}
    out = {k: draw(either(v)) for k, v in valid.items()}
    out.update(draw(st.dictionaries(st.text(max_size=8), JSON, max_size=2)))
    return _present(out)


@st.composite
def pull_headers(draw) -> dict:
    valid = {"op": "pull", "version": 0, "layers": draw(st.sampled_from([["a"], ["b"], ["a", "b"]])),
             "dtype": draw(st.sampled_from(["bf16", "fp32"]))}
    return _present({k: draw(either(v)) for k, v in valid.items()})


def mac(key: bytes, *parts: bytes) -> bytes:
    m = hmac.new(key, digestmod="sha256")
    for p in parts:
        m.update(p)
    return m.digest()
