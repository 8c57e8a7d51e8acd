"""Catalogue entries as a peer gossips them, with generated values for every field: an entry
whose body holds a value out of range is refused with CatalogError naming the field, even
signed by a member, and nothing else comes out of decoding it or of merging what peers
gossip."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace
from typing import Any

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshagent.catalog import entry as entry_module
from meshagent.catalog.entry import MAX_ENTRY_BYTES, SignedEntry
from meshagent.catalog.service import Catalog
from meshagent.errors import CatalogError
from meshagent.identity.keys import NodeIdentity
from meshagent.models.artifacts import ArtifactStore
from tests.catalog.support import add_entry, signed_add
from tests.peer_values import any_cbor, outside, wide_ints

ME = NodeIdentity.generate()
BODY = add_entry(split_refusal="recurrent layers", vocab_sha256="cd" * 32).to_wire()
N = BODY[9]
KEYS = entry_module._KEYS

not_a_bool = st.one_of(st.integers(-2, 2), st.none(), st.floats(), st.text(max_size=5))
not_text = st.one_of(
    st.integers(-(2**70), 2**70), wide_ints, st.none(), st.binary(max_size=8), st.booleans()
)
unprintable = st.sampled_from(["a\nb", "\x00", "tab\there", "\x1b[31m"])
not_a_number = st.one_of(
    st.floats().filter(lambda f: not 0 <= f <= 1e18),
    st.sampled_from([math.nan, math.inf, True, "1", None, -1, 10**19]),
    wide_ints,
)

# Every field the body carries: (field name, values it may not be).
FIELDS: list[tuple[str, st.SearchStrategy[Any]]] = [
    (
        "name",
        st.one_of(
            not_text,
            st.sampled_from(["", "a" * 129, "-x", ".x", "a b", "a:b", "a/b", "../x", "é"]),
        ),
    ),
    ("op", st.one_of(not_text, st.sampled_from(["", "ADD", "delete", "add "]))),
    ("version", outside(range(1, 2**32))),
    ("time", outside(range(0, 2**40))),
    ("source", st.one_of(not_text, st.just("s" * 256), unprintable)),
    (
        "sha256",
        st.one_of(
            not_text,
            st.text(max_size=70).filter(lambda t: len(t) != 64),
            st.sampled_from(["AB" * 32, "g" * 64, " " * 64]),
        ),
    ),
    ("size", outside(range(1, 2**53))),
    ("architecture", st.one_of(not_text, st.just("a" * 65), unprintable)),
    ("n_layers", outside(range(1, 1 << 16))),
    (
        "layer_bytes",
        st.one_of(
            not_text,
            st.just([]),
            st.lists(not_text, min_size=1, max_size=2),
            st.sampled_from([[[10, N - 1]], [[10, N + 1]], [[10, N], [10, 1]], [[10, 0], [10, N]]]),
            st.sampled_from([[[10, N, 1]], [[-1, N]], [[2**53, N]], [[True, N]], [[1.0, N]]]),
            st.sampled_from([[[10, 2**16 - 1]], [[10, 1]] * (N + 1), [[10]]]),
            outside(range(0, 2**53)).map(lambda b: [[b, N]]),
            outside(range(1, 1 << 16)).map(lambda c: [[10, c]]),
        ),
    ),
    ("embedding_bytes", outside(range(0, 2**53))),
    ("head_bytes", outside(range(0, 2**53))),
    ("other_bytes", outside(range(0, 2**53))),
    ("kv_bytes_per_token_per_layer", outside(range(0, 2**32))),
    ("flops_per_layer", not_a_number),
    ("tied_embeddings", not_a_bool),
    (
        "split_refusal",
        st.one_of(
            not_text.filter(lambda v: v is not None), st.just(""), st.just("r" * 256), unprintable
        ),
    ),
    ("n_embd", outside(range(0, 1 << 20))),
    ("n_vocab", outside(range(0, 1 << 24))),
    ("tokenizer_bytes", outside(range(0, 2**53))),
    (
        "vocab_sha256",
        st.one_of(
            not_text,
            st.text(min_size=1, max_size=70).filter(lambda t: len(t) != 64),
            st.sampled_from(["CD" * 32, "g" * 64]),
        ),
    ),
]


def signed_blob(body: dict[int, Any], identity: NodeIdentity = ME) -> bytes:
    """`body` signed by `identity` as a catalogue entry: what a member can gossip."""
    raw = cbor2.dumps(body, canonical=True)
    return cbor2.dumps(
        {0: 1, 1: raw, 2: identity.public_key, 3: identity.sign(entry_module._CONTEXT + raw)}
    )


def test_the_table_names_every_field():
    assert {KEYS[name] for name, _ in FIELDS} == set(BODY) == set(KEYS.values())


def test_the_untouched_body_is_an_entry():
    assert SignedEntry.from_bytes(signed_blob(BODY)).entry == add_entry(
        split_refusal="recurrent layers", vocab_sha256="cd" * 32
    )


def test_an_entry_without_a_vocabulary_digest_is_one_whose_vocabulary_is_unknown():
    body = {k: v for k, v in BODY.items() if k != KEYS["vocab_sha256"]}
    assert SignedEntry.from_bytes(signed_blob(body)).entry.vocab_sha256 == ""


@pytest.mark.parametrize(("named", "values"), FIELDS, ids=[name for name, _ in FIELDS])
@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_field_out_of_range_is_refused_naming_it(named, values, data):
    value = data.draw(values, label=named)
    blob = signed_blob({**BODY, KEYS[named]: value})
    # (A value too big to name, a bignum, makes the entry too big to read.)
    named = f"'{named}'" if len(blob) <= MAX_ENTRY_BYTES else "over the limit"
    with pytest.raises(CatalogError, match=named):
        SignedEntry.from_bytes(blob)


@pytest.mark.parametrize(
    "named", [name for name, _ in FIELDS if name not in ("split_refusal", "vocab_sha256")]
)
def test_an_entry_without_a_field_is_refused_naming_it(named):
    body = {k: v for k, v in BODY.items() if k != KEYS[named]}
    with pytest.raises(CatalogError, match=named):
        SignedEntry.from_bytes(signed_blob(body))


@pytest.mark.parametrize("extra", [{22: 1}, {"name": "x"}, {-1: 0}])
def test_an_entry_with_a_field_of_no_version_is_refused(extra):
    with pytest.raises(CatalogError, match="no field"):
        SignedEntry.from_bytes(signed_blob({**BODY, **extra}))


@settings(max_examples=300)
@given(st.dictionaries(st.sampled_from(sorted(BODY)), any_cbor(24, size=16, leaves=12), max_size=6))
def test_any_body_decodes_or_is_refused_with_a_catalog_error(changes):
    with contextlib.suppress(CatalogError):
        SignedEntry.from_bytes(signed_blob({**BODY, **changes}))


@settings(max_examples=300)
@given(st.one_of(any_cbor(4, size=40), st.binary(max_size=100)))
def test_any_gossiped_blob_decodes_or_is_refused_with_a_catalog_error(value):
    data = value if isinstance(value, bytes) else cbor2.dumps(value)
    with contextlib.suppress(CatalogError):
        SignedEntry.from_bytes(data)


def gossiping(*blobs: bytes) -> SimpleNamespace:
    """A peer's view whose record carries `blobs`."""
    return SimpleNamespace(record=SimpleNamespace(catalog=blobs))


@pytest.mark.parametrize(
    ("named", "value"),
    [("size", -1), ("version", 10**5000), ("layer_bytes", [[1, 2**16 - 1]] * 4), ("name", 5)],
    ids=["size-negative", "version-bignum", "layers-too-many", "name-int"],
)
def test_a_peer_gossiping_a_bad_entry_is_skipped_not_raised(tmp_path, named, value):
    """A bad entry is logged and skipped; a good one, even in the same record, is merged."""
    good = signed_add(NodeIdentity.generate(), name="good-model")
    views = {"bad": gossiping(signed_blob({**BODY, KEYS[named]: value}), good.to_bytes())}
    catalog = Catalog(ME, tmp_path / "catalog.cbor", ArtifactStore(tmp_path / "a"))
    assert catalog.heard(views)
    assert list(catalog.entries()) == ["good-model"]
