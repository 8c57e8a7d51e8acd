"""Catalogue entries: signed and verified, every field checked at decode, and an add built from
a model file's layout gives placement that model's cost."""

from __future__ import annotations

from pathlib import Path

import cbor2
import pytest

from meshagent.catalog import entry as entry_module
from meshagent.catalog.entry import MAX_ENTRY_BYTES, CatalogEntry, SignedEntry
from meshagent.errors import CatalogError
from meshagent.identity.keys import NodeIdentity
from meshagent.models.layout import inspect_model
from meshagent.placement.planner import ModelCost
from meshagent.testing.tiny_gguf import write_tiny_model
from tests.catalog.support import SHA, T0, add_entry, signed_add, signed_remove

ME = NodeIdentity.generate()


def test_an_add_and_a_removal_round_trip_and_name_their_author():
    for signed in (signed_add(ME), signed_remove(ME)):
        back = SignedEntry.from_bytes(signed.to_bytes())
        assert back == signed
        assert back.author == ME.peer_id
        assert back.to_bytes() == signed.to_bytes()


def test_an_add_of_a_model_file_carries_its_cost(tmp_path: Path):
    layout = inspect_model(write_tiny_model(tmp_path / "tiny.gguf", "llama"))
    entry = CatalogEntry.add(
        "tiny", "/models/tiny.gguf", SHA, layout.file_bytes, layout, version=3, time=T0
    )
    back = SignedEntry.from_bytes(entry.sign(ME).to_bytes()).entry
    assert back.cost() == ModelCost.from_layout("tiny", layout)
    assert (back.size, back.architecture, back.version) == (layout.file_bytes, "llama", 3)


def test_layer_bytes_travel_as_runs():
    entry = add_entry(layer_bytes=(1000, 1000, 1000, 1200))
    assert entry.to_wire()[10] == [[1000, 3], [1200, 1]]


def _q4_k_m_layers(n: int) -> tuple[int, ...]:
    """llama.cpp's Q4_K_M gives some layers' tensors more bits: the first and last eighth,
    and every third layer between."""
    more = [i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2 for i in range(n)]
    return tuple(436_000_000 + (30_000_000 if m else 0) for m in more)


def test_an_80_layer_model_with_mixed_quantisation_fits_in_a_kilobyte():
    entry = add_entry(
        "Meta-Llama-3.1-70B-Instruct-Q4_K_M",
        source="bartowski/Meta-Llama-3.1-70B-Instruct-GGUF:Q4_K_M",
        size=42_520_393_888,
        n_layers=80,
        layer_bytes=_q4_k_m_layers(80),
        embedding_bytes=1_100_000_000,
        head_bytes=1_700_000_000,
        n_embd=8192,
        n_vocab=128_256,
        split_refusal=None,
    )
    blob = entry.sign(ME).to_bytes()
    assert len(blob) <= 800 < MAX_ENTRY_BYTES
    assert SignedEntry.from_bytes(blob).entry.layer_bytes == _q4_k_m_layers(80)


def test_an_entry_over_a_kilobyte_is_not_signed():
    entry = add_entry(n_layers=200, layer_bytes=tuple(range(1000, 1200)))
    with pytest.raises(CatalogError, match="over the 1024-byte limit"):
        entry.sign(ME)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"name": "my model"}, "name"),
        ({"name": "a" * 129}, "name"),
        ({"name": "-x"}, "name"),
        ({"version": 0}, "version"),
        ({"size": 0}, "size"),
        ({"sha256": "AB" * 32}, "sha256"),
        ({"source": "bad\nsource"}, "source"),
        ({"flops_per_layer": float("nan")}, "flops_per_layer"),
        ({"split_refusal": ""}, "split_refusal"),
        ({"n_layers": 3}, "layer_bytes"),
    ],
)
def test_an_entry_out_of_range_is_not_signed(change, named):
    with pytest.raises(CatalogError, match=named):
        add_entry(**change).sign(ME)


def test_a_tampered_entry_is_refused_whatever_byte_changed():
    blob = signed_add(ME).to_bytes()
    for i in range(len(blob)):
        altered = bytearray(blob)
        altered[i] ^= 0x01
        with pytest.raises(CatalogError):
            SignedEntry.from_bytes(bytes(altered))


def test_an_entry_signed_by_one_key_and_claimed_by_another_is_refused():
    other = NodeIdentity.generate()
    d = cbor2.loads(signed_add(ME).to_bytes())
    d[2] = other.public_key
    with pytest.raises(CatalogError, match="signature"):
        SignedEntry.from_bytes(cbor2.dumps(d))


def test_a_signature_for_another_kind_of_record_is_refused():
    body = cbor2.dumps(add_entry().to_wire(), canonical=True)
    sig = ME.sign(b"meshagent/capability-record/v1\x00" + body)
    with pytest.raises(CatalogError, match="signature"):
        SignedEntry.from_bytes(cbor2.dumps({0: 1, 1: body, 2: ME.public_key, 3: sig}))


def _signed_body(body: dict) -> bytes:
    raw = cbor2.dumps(body, canonical=True)
    sig = ME.sign(entry_module._CONTEXT + raw)
    return cbor2.dumps({0: 1, 1: raw, 2: ME.public_key, 3: sig})


def test_a_removal_with_a_models_fields_and_an_add_without_one_are_refused():
    removal = CatalogEntry.remove("m", version=2, time=T0).to_wire()
    with pytest.raises(CatalogError, match="no field 'sha256'"):
        SignedEntry.from_bytes(_signed_body({**removal, 6: SHA}))
    add = add_entry().to_wire()
    del add[7]
    with pytest.raises(CatalogError, match="lacks field 'size'"):
        SignedEntry.from_bytes(_signed_body(add))
    with pytest.raises(CatalogError, match="'op'"):
        SignedEntry.from_bytes(_signed_body({**add_entry().to_wire(), 2: "replace"}))


def test_a_model_that_may_not_split_says_why():
    entry = add_entry(split_refusal="state-space layers")
    back = SignedEntry.from_bytes(entry.sign(ME).to_bytes()).entry
    assert back.cost().split_refusal == "state-space layers"
    assert 17 not in add_entry().to_wire()


def test_a_removal_has_no_cost():
    with pytest.raises(CatalogError, match="removes it"):
        CatalogEntry.remove("m", version=2, time=T0).cost()


def test_the_json_form_says_who_did_what():
    added = signed_add(ME).to_dict()
    assert added["author"] == ME.peer_id and added["added_at"] == T0
    assert (added["op"], added["sha256"], added["layers"], added["splittable"]) == (
        "add",
        SHA,
        4,
        True,
    )
    removed = signed_remove(ME).to_dict()
    assert removed == {
        "name": "tiny-llama",
        "op": "remove",
        "version": 2,
        "author": ME.peer_id,
        "removed_at": T0,
    }


@pytest.mark.parametrize("blob", [b"", b"\xff", cbor2.dumps([1, 2]), cbor2.dumps({0: 2}), 5])
def test_garbage_is_refused_with_a_catalog_error(blob):
    with pytest.raises(CatalogError):
        SignedEntry.from_bytes(blob)


def test_an_entry_of_another_format_version_is_refused():
    d = cbor2.loads(signed_add(ME).to_bytes())
    for version in (2, True, 1.0):
        with pytest.raises(CatalogError, match="format"):
            SignedEntry.from_bytes(cbor2.dumps({**d, 0: version}))
