"""Records, heartbeats and obituaries: round trips, bounds, and forgeries refused."""

from __future__ import annotations

from dataclasses import replace

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshagent.gossip.errors import RecordRejected
from meshagent.gossip.peer_record import (
    MAX_CATALOG,
    MAX_CATALOG_BYTES,
    MAX_DRAFT_GFLOPS,
    MAX_RECORD_BYTES,
    ArtifactHeld,
    DeviceOffer,
    ModelHeld,
    PeerRecord,
    Serving,
)
from meshagent.gossip.signed import Heartbeat, Obituary, SignedRecord
from meshagent.identity.keys import NodeIdentity
from tests.gossip.support import MESH

H = "ab" * 32


def full_record(ident: NodeIdentity, seq: int = 5) -> PeerRecord:
    return PeerRecord(
        peer_id=ident.peer_id,
        public_key=ident.public_key,
        seq=seq,
        issued_at=1700000000.5,
        name="laptop",
        agent_version="0.1.0",
        addresses=("10.0.0.2:9338",),
        relays=("relay.example:7000",),
        mem_weights_bytes=8 << 30,
        mem_kv_bytes=2 << 30,
        compute_speed=42.5,
        compute_unit="matmul_gflops_f32",
        rtts_ms=(("otherpeer", 1.25),),
        models=(ModelHeld("SmolLM2", H, "llama", 30, 100_000_000),),
        artifacts=(
            ArtifactHeld(
                key="k",
                sha256=H,
                kind="layers",
                source_sha256=H,
                source_name="m.gguf",
                start=0,
                end=10,
                total_layers=30,
                size_bytes=1,
                weight_bytes=1,
                kv_bytes_per_token_per_layer=2,
            ),
        ),
        serving=(Serving("SmolLM2", H, 0, 30, 30),),
        extras={"lease": {"epoch": 3, "layers": [0, 10]}},
        capabilities=(b"\xa4signed-capability-record",),
        windows_inexact="llama.cpp was built with LLAMAFILE",
        devices=(DeviceOffer("CUDA0", "NVIDIA H200", "gpu", 150 << 30, 140 << 30, 20 << 30, 9e3),),
        mem_spare_bytes=4 << 30,
        no_tokenizer=(H,),
        catalog=(b"\xa4signed-catalogue-entry",),
    )


def test_signed_record_round_trips_and_verifies():
    ident = NodeIdentity.generate()
    rec = full_record(ident)
    signed = SignedRecord.sign(rec, ident, MESH)
    back = SignedRecord.from_cbor(signed.raw, MESH)
    assert back.record == rec
    assert back.raw == signed.raw
    assert rec.rtt_to("otherpeer") == 1.25
    assert rec.to_dict()["models"][0]["n_layers"] == 30


def test_gpus_and_spare_memory_are_absent_from_a_cpu_agents_record():
    # A record without them encodes as before they existed (old agents read it alike), and
    # a record with them decodes on an agent that ignores unknown keys.
    ident = NodeIdentity.generate()
    rec = replace(full_record(ident), devices=(), mem_spare_bytes=0, no_tokenizer=())
    wire = cbor2.loads(rec.to_body())
    assert 20 not in wire and 21 not in wire and 22 not in wire
    full = cbor2.loads(full_record(ident).to_body())
    assert full[20] == [["CUDA0", "NVIDIA H200", "gpu", 150 << 30, 140 << 30, 20 << 30, 9e3]]
    assert full[21] == 4 << 30
    assert full[22] == [H]
    assert full_record(ident).to_dict()["devices"][0]["offer_bytes"] == 20 << 30


def test_the_catalogue_is_absent_when_empty_and_bounded_when_decoded():
    ident = NodeIdentity.generate()
    assert 23 not in cbor2.loads(replace(full_record(ident), catalog=()).to_body())
    wire = cbor2.loads(full_record(ident).to_body())
    assert wire[23] == [b"\xa4signed-catalogue-entry"]
    assert full_record(ident).to_dict()["catalog"] == 1
    for bad, why in (
        ([b"x"] * (MAX_CATALOG + 1), "at most 32"),
        ([b"x" * (MAX_CATALOG_BYTES + 1)], "bytes of at most"),
        (["text"], "bytes of at most"),
        (b"x", "list"),
    ):
        wire[23] = bad
        with pytest.raises(RecordRejected, match=why):
            PeerRecord.from_body(cbor2.dumps(wire, canonical=True))


def test_a_nat_kind_travels_and_any_other_value_is_refused():
    ident = NodeIdentity.generate()
    assert 24 not in cbor2.loads(full_record(ident).to_body())  # absent when ""
    wire = cbor2.loads(replace(full_record(ident), nat="dependent").to_body())
    assert wire[24] == "dependent"
    assert PeerRecord.from_body(cbor2.dumps(wire, canonical=True)).nat == "dependent"
    for bad in ("cone", 1, ["none"], "x" * 300):
        wire[24] = bad
        with pytest.raises(RecordRejected, match="nat must be one of"):
            PeerRecord.from_body(cbor2.dumps(wire, canonical=True))


def test_a_draft_models_compute_travels_and_a_hostile_value_is_refused():
    ident = NodeIdentity.generate()
    assert 26 not in cbor2.loads(full_record(ident).to_body())  # absent without one
    wire = cbor2.loads(replace(full_record(ident), draft_gflops=(0.27, 1.6)).to_body())
    assert wire[26] == [0.27, 1.6]
    assert PeerRecord.from_body(cbor2.dumps(wire, canonical=True)).draft_gflops == (0.27, 1.6)
    for bad in (
        [0.0, 0.0],  # sent only with a draft model
        [-1.0, 0.0],
        [float("nan"), 0.0],
        [float("inf"), 0.0],
        [MAX_DRAFT_GFLOPS * 2, 0.0],
        [0.27, -1.0],
        [0.27],
        "0.27",
        [0.27, 1.6, 3.0],
    ):
        wire[26] = bad
        with pytest.raises(RecordRejected):
            PeerRecord.from_body(cbor2.dumps(wire, canonical=True))


def test_a_malformed_device_is_refused():
    ident = NodeIdentity.generate()
    wire = cbor2.loads(full_record(ident).to_body())
    wire[20] = [["CUDA0", "x", "gpu", -1, 0, 0, 0.0]]
    with pytest.raises(RecordRejected, match="unsigned"):
        PeerRecord.from_body(cbor2.dumps(wire, canonical=True))
    wire[20] = [["CUDA0"]] * 17
    with pytest.raises(RecordRejected, match="at most 16"):
        PeerRecord.from_body(cbor2.dumps(wire, canonical=True))


def test_a_record_from_another_mesh_does_not_verify():
    ident = NodeIdentity.generate()
    signed = SignedRecord.sign(full_record(ident), ident, MESH)
    with pytest.raises(RecordRejected, match="bad signature"):
        SignedRecord.from_cbor(signed.raw, "anothermesh")


def test_a_record_signed_by_someone_else_is_refused():
    owner, forger = NodeIdentity.generate(), NodeIdentity.generate()
    body = full_record(owner).to_body()
    sig = forger.sign(b"meshagent/gossip-record/v1\x00" + MESH.encode() + body)
    with pytest.raises(RecordRejected, match="bad signature"):
        SignedRecord.from_cbor(cbor2.dumps({0: 1, 1: body, 2: sig}), MESH)


def test_a_record_claiming_another_peer_id_is_refused():
    victim, forger = NodeIdentity.generate(), NodeIdentity.generate()
    rec = full_record(forger)
    rec = PeerRecord(**{**rec.__dict__, "peer_id": victim.peer_id})
    body = rec.to_body()
    sig = forger.sign(b"meshagent/gossip-record/v1\x00" + MESH.encode() + body)
    with pytest.raises(RecordRejected, match="another peer's key"):
        SignedRecord.from_cbor(cbor2.dumps({0: 1, 1: body, 2: sig}), MESH)


def test_a_tampered_record_is_refused():
    ident = NodeIdentity.generate()
    raw = bytearray(SignedRecord.sign(full_record(ident), ident, MESH).raw)
    i = raw.find(b"laptop")
    raw[i] ^= 1
    with pytest.raises(RecordRejected):
        SignedRecord.from_cbor(bytes(raw), MESH)


def test_an_oversized_record_is_refused_by_its_owner_and_by_receivers():
    ident = NodeIdentity.generate()
    rec = PeerRecord(ident.peer_id, ident.public_key, 1, extras={"x": b"\0" * MAX_RECORD_BYTES})
    with pytest.raises(RecordRejected, match="over the"):
        SignedRecord.sign(rec, ident, MESH)
    with pytest.raises(RecordRejected):
        SignedRecord.from_cbor(b"\0" * (MAX_RECORD_BYTES + 1024), MESH)


def test_a_record_without_capabilities_encodes_as_before():
    ident = NodeIdentity.generate()
    body = cbor2.loads(replace(full_record(ident), capabilities=(), windows_inexact="").to_body())
    assert 18 not in body and 19 not in body
    assert {18, 19} <= set(cbor2.loads(full_record(ident).to_body()))


@pytest.mark.parametrize(
    "field, value",
    [
        (9, -1),  # negative memory
        (11, float("nan")),
        (7, ["a"] * 17),  # too many addresses
        (5, "x" * 300),  # over-long name
        (15, [["k", "short-hash", "layers", "x", "n", 0, 1, 1, 1, 1, 1]]),
        (16, [["m", "", 5, 2, 30]]),  # start > end
        (18, ["not bytes"]),
        (18, [b"x"] * 9),  # too many capability records
        (18, [b"x" * 9000]),  # one too large
    ],
)
def test_malformed_fields_are_refused_at_decode(field, value):
    ident = NodeIdentity.generate()
    d = cbor2.loads(full_record(ident).to_body())
    d[field] = value
    with pytest.raises(RecordRejected):
        PeerRecord.from_body(cbor2.dumps(d))


def test_heartbeat_and_obituary_verify_and_refuse_forgeries():
    a, b = NodeIdentity.generate(), NodeIdentity.generate()
    hb = Heartbeat.sign(a, 1234, MESH)
    back = Heartbeat.decode(hb.to_cbor()).verify(MESH)
    assert back.peer_id == a.peer_id and back.beat == 1234
    forged = Heartbeat(a.public_key, 1235, hb.signature)
    with pytest.raises(RecordRejected):
        Heartbeat.decode(forged.to_cbor()).verify(MESH)
    ob = Obituary.sign(b, a.peer_id, 1234, MESH)
    assert Obituary.decode(ob.to_cbor()).verify(MESH).reporter == b.peer_id
    with pytest.raises(RecordRejected):
        Obituary(a.peer_id, 9999, b.public_key, ob.signature).verify(MESH)


@given(st.binary(max_size=300))
def test_garbage_never_decodes_to_an_item(data):
    for decode in (
        lambda d: SignedRecord.from_cbor(d, MESH),
        lambda d: Heartbeat.decode(d).verify(MESH),
        lambda d: Obituary.decode(d).verify(MESH),
    ):
        with pytest.raises(RecordRejected):
            decode(data)
