"""Every integer field of every gossip message and item, given a value out of its range, is
refused with its decoder's error (ExchangeError for messages, RecordRejected for items), and
no input makes a decoder raise anything else."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.gossip.errors import ExchangeError, RecordRejected
from meshagent.gossip.messages import decode
from meshagent.gossip.peer_record import PeerRecord
from meshagent.gossip.signed import Heartbeat, Obituary, SignedRecord
from meshagent.identity.keys import NodeIdentity
from tests.gossip.support import MESH

U64 = 1 << 64
MAX_BEAT = (1 << 63) - 1
PEER = NodeIdentity.generate()
KEY = PEER.public_key
SHA = "ab" * 32

# Integers past the 4300 digits Python prints (a CBOR bignum of some 2 KB): a decoder that
# quotes one with repr() or str() raises ValueError instead of its own error.
huge = st.integers(4400, 5000).map(lambda n: 10**n)
wide = st.one_of(huge, huge.map(lambda v: -v))

not_an_int = st.one_of(
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(0, 3), max_size=2),
)


def out_of(most: int) -> st.SearchStrategy[Any]:
    """Values outside [0, most]: negative, past `most` (bignums too), or not integers."""
    return st.one_of(
        st.integers(max_value=-1),
        st.integers(min_value=most + 1, max_value=most + 2**70),
        st.just(most + 1),
        wide,
        not_an_int,
    )


def entry(seq: Any = 1, beat: Any = 1) -> list[Any]:
    return [PEER.peer_id, seq, beat, False]


# ----- messages: DIGEST, DELTA (wants), BUSY --------------------------------------------------


@given(out_of(U64 - 1))
def test_a_digest_entry_seq_out_of_range_is_refused(seq):
    with pytest.raises(ExchangeError):
        decode(cbor2.dumps({0: 1, 1: 1, 2: [entry(seq=seq)]}))


@given(out_of(MAX_BEAT))
def test_a_digest_entry_beat_out_of_range_is_refused(beat):
    with pytest.raises(ExchangeError):
        decode(cbor2.dumps({0: 1, 1: 1, 2: [entry(beat=beat)]}))


@given(
    st.one_of(
        out_of(U64 - 1).map(lambda v: {"seq": v}), out_of(MAX_BEAT).map(lambda v: {"beat": v})
    )
)
def test_a_want_out_of_range_is_refused(field):
    want = entry(**field)
    with pytest.raises(ExchangeError):
        decode(cbor2.dumps({0: 1, 1: 2, 3: [], 4: [], 5: [], 6: [want]}))


@given(st.one_of(st.integers().filter(lambda v: v != 1), wide, not_an_int))
def test_a_message_version_out_of_range_is_refused(version):
    with pytest.raises(ExchangeError):
        decode(cbor2.dumps({0: version, 1: 1, 2: []}))


@given(st.one_of(st.integers().filter(lambda v: v not in (1, 2, 3)), wide, not_an_int))
def test_a_message_type_out_of_range_is_refused(kind):
    with pytest.raises(ExchangeError):
        decode(cbor2.dumps({0: 1, 1: kind, 2: []}))


@given(st.one_of(st.text(min_size=201, max_size=300), st.integers(), wide, st.binary()))
def test_a_busy_reason_that_is_not_short_text_is_refused(reason):
    with pytest.raises(ExchangeError):
        decode(cbor2.dumps({0: 1, 1: 3, 7: reason}))


cbor_values = st.recursive(
    st.one_of(st.integers(-(2**70), 2**70), wide, st.binary(max_size=40), st.text(max_size=70)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.integers(0, 8), inner, max_size=5)
    ),
    max_leaves=20,
)


@settings(max_examples=300)
@given(st.dictionaries(st.integers(0, 8), cbor_values, max_size=8))
def test_any_map_decodes_or_is_refused_with_an_exchange_error(fields):
    with contextlib.suppress(ExchangeError):
        decode(cbor2.dumps(fields))


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_are_refused_with_an_exchange_error(data):
    with contextlib.suppress(ExchangeError):
        decode(data)


# ----- signed items: heartbeats, obituaries --------------------------------------------------


@given(out_of(MAX_BEAT))
def test_a_heartbeat_beat_out_of_range_is_refused(beat):
    with pytest.raises(RecordRejected):
        Heartbeat.decode(cbor2.dumps({0: 1, 1: KEY, 2: beat, 3: bytes(64)}))


@given(out_of(MAX_BEAT))
def test_an_obituary_beat_out_of_range_is_refused(beat):
    with pytest.raises(RecordRejected):
        Obituary.decode(cbor2.dumps({0: 1, 1: PEER.peer_id, 2: beat, 3: KEY, 4: bytes(64)}))


@given(st.one_of(st.integers().filter(lambda v: v != 1), wide, not_an_int))
def test_an_item_version_out_of_range_is_refused(version):
    with pytest.raises(RecordRejected):
        Heartbeat.decode(cbor2.dumps({0: version, 1: KEY, 2: 1, 3: bytes(64)}))


@settings(max_examples=300)
@given(st.dictionaries(st.integers(0, 5), cbor_values, max_size=6))
def test_any_item_decodes_or_is_refused(fields):
    data = cbor2.dumps(fields)
    for parse in (
        Heartbeat.decode,
        Obituary.decode,
        lambda d: SignedRecord.from_cbor(d, MESH),
    ):
        with contextlib.suppress(RecordRejected):
            parse(data)


@given(wide)
def test_an_item_with_a_key_of_its_own_is_refused(key):
    """A key no item has, too wide to print: refused, the key named by its width."""
    data = cbor2.dumps({0: 1, 1: KEY, 2: 1, key: bytes(64)})
    for parse in (Heartbeat.decode, Obituary.decode, lambda d: SignedRecord.from_cbor(d, MESH)):
        with pytest.raises(RecordRejected):
            parse(data)


@pytest.mark.parametrize("keys", [(0, 2, 3), (0, 1, 5), (0, 3, 4, 5), (0, 1, 2, 4, 6)])
def test_an_item_without_one_of_its_keys_is_refused(keys):
    """As many keys as the item has, but not its own: refused, never a KeyError."""
    data = cbor2.dumps({k: (1 if k == 0 else bytes(64)) for k in keys})
    for parse in (Heartbeat.decode, Obituary.decode, lambda d: SignedRecord.from_cbor(d, MESH)):
        with pytest.raises(RecordRejected):
            parse(data)


# ----- records: every integer field ----------------------------------------------------------

MODEL = ["m", SHA, "llama", 30, 1000]
ARTIFACT = ["k", SHA, "layers", SHA, "m.gguf", 0, 10, 30, 100, 90, 64]
SERVING = ["m", SHA, 0, 10, 30]
DEVICE = ["CUDA0", "H200", "gpu", 100, 90, 80, 1.0]


def body() -> dict[int, Any]:
    """A record's wire map with one model, artifact, serving entry and device."""
    d = cbor2.loads(PeerRecord(PEER.peer_id, KEY, 5).to_body())
    return d | {14: [MODEL], 15: [ARTIFACT], 16: [SERVING], 20: [DEVICE]}


def with_item(key: int, template: list[Any], index: int, value: Any) -> dict[int, Any]:
    item = list(template)
    item[index] = value
    return body() | {key: [item]}


# (where in the record, how to put a value there)
INTEGER_FIELDS = [
    *((f"field {k}", lambda v, k=k: body() | {k: v}) for k in (3, 9, 10, 21)),
    *((f"model[{i}]", lambda v, i=i: with_item(14, MODEL, i, v)) for i in (3, 4)),
    *((f"artifact[{i}]", lambda v, i=i: with_item(15, ARTIFACT, i, v)) for i in range(5, 11)),
    *((f"serving[{i}]", lambda v, i=i: with_item(16, SERVING, i, v)) for i in (2, 3, 4)),
    *((f"device[{i}]", lambda v, i=i: with_item(20, DEVICE, i, v)) for i in (3, 4, 5)),
]


def test_the_template_record_decodes():
    record = PeerRecord.from_body(cbor2.dumps(body(), canonical=True))
    assert record.models[0].n_layers == 30 and record.devices[0].offer_bytes == 80


@pytest.mark.parametrize(("where", "put"), INTEGER_FIELDS, ids=[w for w, _ in INTEGER_FIELDS])
@given(value=out_of(U64 - 1))
def test_a_record_integer_out_of_range_is_refused(where, put, value):
    with pytest.raises(RecordRejected):
        PeerRecord.from_body(cbor2.dumps(put(value)))


# (where in the record, how to put a value there): the fields that are numbers
FLOAT_FIELDS = [
    *((f"field {k}", lambda v, k=k: body() | {k: v}) for k in (4, 11)),
    ("rtt", lambda v: body() | {13: [["p", v]]}),
    ("device[6]", lambda v: with_item(20, DEVICE, 6, v)),
]


def test_the_number_fields_take_a_number():
    for _, put in FLOAT_FIELDS:
        PeerRecord.from_body(cbor2.dumps(put(2.5)))
        PeerRecord.from_body(cbor2.dumps(put(7)))


@pytest.mark.parametrize(("where", "put"), FLOAT_FIELDS, ids=[w for w, _ in FLOAT_FIELDS])
@given(
    value=st.one_of(
        st.just(10**400),  # no float holds it
        st.integers(309, 5000).map(lambda n: 10**n),
        st.floats(max_value=-1e-300),
        st.sampled_from([math.inf, -math.inf, math.nan]),
        wide,
        not_an_int.filter(lambda v: not isinstance(v, float)),
    )
)
def test_a_record_number_out_of_range_is_refused(where, put, value):
    with pytest.raises(RecordRejected):
        PeerRecord.from_body(cbor2.dumps(put(value)))
