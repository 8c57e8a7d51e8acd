"""Capability records: signed, verified on every read, and what `--wire-dtype auto` picks."""

from __future__ import annotations

from dataclasses import replace

import cbor2
import pytest

from meshagent.errors import ModelError
from meshagent.identity.keys import NodeIdentity
from meshagent.models.capability import (
    CapabilityRecord,
    CapabilityStore,
    SignedRecord,
    WireResult,
    choose_wire_dtype,
)


def record(certifier: str, *, f16_exact: bool = False) -> CapabilityRecord:
    return CapabilityRecord(
        model_sha256="ab" * 32,
        model_name="tiny",
        architecture="llama",
        n_layers=4,
        splittable=True,
        layer_types=("attention",) * 4,
        state_kind="kv",
        state_portable=True,
        cuts=((0, 2, 4), (0, 1, 3, 4)),
        wire=(
            WireResult("f32", 1.0, 0.0, True, True, 96),
            WireResult("f16", 1.0 if f16_exact else 0.98, 0.4, f16_exact, True, 96),
        ),
        certified_ctx=512,
        llama_cpp_version="0.3.36",
        certifier=certifier,
        certified_at=1_780_000_000.0,
        prompts=("chat", "code"),
    )


def test_a_signed_record_round_trips_and_names_its_exact_dtypes():
    me = NodeIdentity.generate()
    signed = record(me.peer_id).sign(me)
    back = SignedRecord.from_bytes(signed.to_bytes())
    assert back.record == signed.record
    assert back.record.exact_dtypes() == ("f32",)
    assert back.record.to_dict()["wire"][1]["exact"] is False


def claim_f16_exact(signed: SignedRecord) -> bytes:
    """The signed record's bytes with its body changed to claim f16 exact, signature kept."""
    body = cbor2.loads(signed.body)
    body["wire"][1]["greedy_identical"] = True
    return cbor2.dumps(
        {0: 1, 1: cbor2.dumps(body, canonical=True), 2: signed.public_key, 3: signed.signature}
    )


def test_a_tampered_record_is_refused():
    me = NodeIdentity.generate()
    forged = claim_f16_exact(record(me.peer_id).sign(me))
    with pytest.raises(ModelError, match="bad signature"):
        SignedRecord.from_bytes(forged)


def test_a_record_signed_by_another_key_than_its_certifier_is_refused():
    me, other = NodeIdentity.generate(), NodeIdentity.generate()
    with pytest.raises(ModelError, match="signed by the agent it names"):
        record(other.peer_id).sign(me)
    signed = record(me.peer_id).sign(me)
    resigned = cbor2.dumps(
        {0: 1, 1: signed.body, 2: other.public_key, 3: other.sign(b"x" + signed.body)}
    )
    with pytest.raises(ModelError):
        SignedRecord.from_bytes(resigned)


@pytest.mark.parametrize("garbage", [b"", b"\xff\x00", cbor2.dumps([1, 2]), b"x" * 9000])
def test_garbage_is_refused_with_a_clear_error(garbage):
    with pytest.raises(ModelError, match="capability record"):
        SignedRecord.from_bytes(garbage)


def test_the_store_refuses_a_file_changed_on_disk(tmp_path):
    me = NodeIdentity.generate()
    store = CapabilityStore(tmp_path / "capabilities")
    path = store.put(record(me.peer_id).sign(me))
    assert store.get("ab" * 32).record.model_name == "tiny"
    data = bytearray(path.read_bytes())
    data[-70] ^= 1  # a bit of the body... or the signature: either way it must not verify
    path.write_bytes(bytes(data))
    with pytest.raises(ModelError):
        store.get("ab" * 32)
    assert store.all() == []
    assert store.get("cd" * 32) is None


def test_auto_takes_the_cheapest_exact_dtype_and_f32_without_a_record():
    me = NodeIdentity.generate()
    assert choose_wire_dtype("auto", None).dtype == "f32"
    assert not choose_wire_dtype("auto", None).certified_exact
    only_f32 = choose_wire_dtype("auto", record(me.peer_id))
    assert (only_f32.dtype, only_f32.certified_exact) == ("f32", True)
    both = choose_wire_dtype("auto", record(me.peer_id, f16_exact=True))
    assert (both.dtype, both.certified_exact) == ("f16", True)
    forced = choose_wire_dtype("f16", record(me.peer_id))
    assert (forced.dtype, forced.certified_exact) == ("f16", False)
    assert "--wire-dtype" in forced.reason


def test_a_failed_soak_takes_exactness_away():
    w = WireResult("f32", 1.0, 0.0, True, True, 96)
    assert w.exact and replace(w, soak_identical=True).exact
    assert not replace(w, soak_identical=False).exact
