"""Capability records as a peer gossips them, with generated values for every field: a record
whose body holds a value out of range is refused with ModelError naming the field, even
signed by the agent it names, and nothing else comes out of decoding it or of looking for a
model's record among the peers'."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace
from typing import Any

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshagent.errors import ModelError
from meshagent.identity.keys import NodeIdentity
from meshagent.models import capability
from meshagent.models.capability import CapabilityStore, SignedRecord
from meshagent.serving.capabilities import Capabilities
from tests.models.test_capability import record
from tests.peer_values import outside, wide_ints

ME = NodeIdentity.generate()
BODY = record(ME.peer_id).to_dict()


not_a_bool = st.one_of(st.integers(-2, 2), st.none(), st.floats(), st.text(max_size=5))
not_text = st.one_of(
    st.integers(-(2**70), 2**70), wide_ints, st.none(), st.binary(max_size=8), st.booleans()
)
few_not_text = st.one_of(st.integers(-(2**70), 2**70), st.none(), st.binary(max_size=8))
not_a_share = st.one_of(
    st.floats().filter(lambda f: not 0 <= f <= 1),
    st.sampled_from([math.nan, True, "1", None, 2, -1]),
    wide_ints,
)
not_a_distance = st.one_of(
    st.floats(max_value=-1e-9), st.sampled_from([math.nan, True, "0", None]), wide_ints
)
not_a_time = st.one_of(
    st.floats(max_value=-1e-9),
    st.sampled_from([math.nan, math.inf, True, "0", None]),
    wide_ints,
)

# Every field the body carries: (path, what the error names, values it may not be).
N = BODY["n_layers"]
FIELDS: list[tuple[tuple[Any, ...], str, st.SearchStrategy[Any]]] = [
    (("version",), "version", outside(range(1, 2))),
    (
        ("model_sha256",),
        "model_sha256",
        st.one_of(
            not_text,
            st.text(max_size=70).filter(lambda t: len(t) != 64),
            st.sampled_from(["../" * 21 + "x", "AB" * 32, "g" * 64]),
        ),
    ),
    (("model_name",), "model_name", st.one_of(not_text, st.just("m" * 256))),
    (("architecture",), "architecture", st.one_of(not_text, st.just("a" * 256))),
    (("n_layers",), "n_layers", outside(range(1, 1 << 16))),
    (("splittable",), "splittable", not_a_bool),
    (
        ("layer_types",),
        "layer_types",
        st.one_of(
            not_text,
            st.lists(few_not_text, min_size=N, max_size=N),
            st.lists(st.just("attention"), max_size=8).filter(lambda t: len(t) != N),
            st.just(["attention"] * (N - 1) + ["mamba"]),
        ),
    ),
    (("state_kind",), "state_kind", st.one_of(not_text, st.sampled_from(["", "KV", "x"]))),
    (("state_portable",), "state_portable", not_a_bool),
    (
        ("cuts",),
        "cuts",
        st.one_of(
            not_text,
            st.lists(not_text, min_size=1, max_size=2),
            st.sampled_from([[[0]], [[0, N]] * 65, [[1, N]], [[0, 2, 2, N]], [[0, 3, 2, N]]]),
            st.sampled_from([[[0, N + 1]], [[0, N - 1]], [[0, True, N]], [[0, 1.0, N]]]),
        ),
    ),
    *((("cuts", 0, i), "cuts", outside(range(0, N + 1))) for i in range(3)),
    (("wire",), "wire", st.one_of(not_text, st.lists(not_text, min_size=1, max_size=2))),
    (("wire", 0, "dtype"), "dtype", st.one_of(not_text, st.just("f" * 17), st.just(""))),
    (("wire", 0, "top1_agreement"), "top1_agreement", not_a_share),
    (("wire", 0, "max_logit_diff"), "max_logit_diff", not_a_distance),
    (("wire", 0, "greedy_identical"), "greedy_identical", not_a_bool),
    (("wire", 0, "chunked_prefill_identical"), "chunked_prefill_identical", not_a_bool),
    (("wire", 0, "positions"), "positions", outside(range(0, 2**31))),
    (("wire", 1, "soak_identical"), "soak_identical", not_a_bool.filter(lambda v: v is not None)),
    (("certified_ctx",), "certified_ctx", outside(range(0, 2**31))),
    (("llama_cpp_version",), "llama_cpp_version", st.one_of(not_text, st.just("v" * 256))),
    (("certifier",), "certifier", st.one_of(not_text, st.just(NodeIdentity.generate().peer_id))),
    (("certified_at",), "certified_at", not_a_time),
    (("prompts",), "prompts", st.one_of(not_text, st.lists(not_text, min_size=1, max_size=2))),
]


def signed_blob(body: dict[str, Any], identity: NodeIdentity = ME) -> bytes:
    """`body` signed by `identity` as a capability record: what a member can gossip."""
    raw = cbor2.dumps(body, canonical=True)
    return cbor2.dumps(
        {0: 1, 1: raw, 2: identity.public_key, 3: identity.sign(capability._CONTEXT + raw)}
    )


def with_value(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    body = cbor2.loads(cbor2.dumps(BODY))  # a deep copy
    *outer, last = path
    holder = body
    for k in outer:
        holder = holder[k]
    holder[last] = value
    return body


def _int_paths(v: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(v, dict):
        return [p for k, x in v.items() for p in _int_paths(x, (*path, k))]
    if isinstance(v, list | tuple):
        return [p for i, x in enumerate(v) for p in _int_paths(x, (*path, i))]
    return [path] if type(v) is int else []


def _any_index(path: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple("*" if type(k) is int else k for k in path)


def test_the_table_names_every_integer_and_every_field():
    ints = {_any_index(p) for p in _int_paths(BODY)}
    listed = {_any_index(p) for p, _, _ in FIELDS}
    assert ints <= listed
    assert {p[0] for p, _, _ in FIELDS} == set(BODY)
    wire_keys = {p[2] for p, _, _ in FIELDS if p[0] == "wire" and len(p) == 3}
    assert wire_keys == set(BODY["wire"][0]) - {"exact"}


def test_the_untouched_body_is_a_record():
    assert SignedRecord.from_bytes(signed_blob(BODY)).record == record(ME.peer_id)


@pytest.mark.parametrize(
    ("path", "named", "values"),
    FIELDS,
    ids=lambda v: "/".join(map(str, v)) if isinstance(v, tuple) else None,
)
@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_field_out_of_range_is_refused_naming_it(path, named, values, data):
    value = data.draw(values, label=named)
    with pytest.raises(ModelError, match=named):
        SignedRecord.from_bytes(signed_blob(with_value(path, value)))


@pytest.mark.parametrize("key", sorted(BODY))
def test_a_record_without_a_field_is_refused_naming_it(key):
    body = {k: v for k, v in BODY.items() if k != key}
    if key == "prompts":  # optional: a record certified before prompts were named
        SignedRecord.from_bytes(signed_blob(body))
        return
    with pytest.raises(ModelError, match=key):
        SignedRecord.from_bytes(signed_blob(body))


@pytest.mark.parametrize("extra", [{"surprise": 1}, {1: 2}])
def test_a_record_with_a_field_of_no_version_is_refused(extra):
    with pytest.raises(ModelError):
        SignedRecord.from_bytes(signed_blob({**BODY, **extra}))


cbor_values = st.recursive(
    st.one_of(
        st.integers(-(2**70), 2**70),
        st.binary(max_size=16),
        st.text(max_size=16),
        st.booleans(),
        st.none(),
        st.floats(),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300)
@given(st.dictionaries(st.sampled_from(sorted(BODY)), cbor_values, max_size=6))
def test_any_body_decodes_or_is_refused_with_a_model_error(changes):
    with contextlib.suppress(ModelError):
        SignedRecord.from_bytes(signed_blob({**BODY, **changes}))


@settings(max_examples=300)
@given(st.one_of(cbor_values, st.binary(max_size=100)))
def test_any_gossiped_blob_decodes_or_is_refused_with_a_model_error(value):
    data = value if isinstance(value, bytes) else cbor2.dumps(value)
    with contextlib.suppress(ModelError):
        SignedRecord.from_bytes(data)


def gossiping(*records: bytes) -> SimpleNamespace:
    """A peer's view whose record carries `records`."""
    return SimpleNamespace(record=SimpleNamespace(capabilities=records))


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("model_sha256",), 5),
        (("model_sha256",), None),
        (("n_layers",), "4"),
        (("certified_at",), 10**400),
        (("wire", 0, "positions"), 10**5000),
        (("cuts",), [[0, "x", 4]]),
    ],
    ids=["hash-int", "hash-none", "layers-text", "time-bignum", "positions-bignum", "cut-text"],
)
def test_a_peer_gossiping_a_bad_record_is_skipped_not_raised(tmp_path, path, value):
    """The agent looks for its model's record among what peers gossip: a bad one is logged
    and skipped, and a good one from another peer is still found."""
    good = record(ME.peer_id).sign(ME)
    views = {
        "bad": gossiping(signed_blob(with_value(path, value))),
        "good": gossiping(good.to_bytes()),
    }
    caps = Capabilities(CapabilityStore(tmp_path), lambda: views)
    found = caps.for_model(good.record.model_sha256)
    assert found is not None and found.record == good.record
