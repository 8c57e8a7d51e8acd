import pytest

from meshagent.wire.ciphers import AESGCM_256, CHACHAPOLY, CIPHERS, choose, preferred, rekey
from meshagent.wire.errors import ProtocolError
from meshagent.wire.handshake import Handshake
from meshagent.wire.sealed_records import RecordReader, RecordSealer
from tests.wire.pairs import peer, run_handshake

KEY = bytes(range(32))


@pytest.mark.parametrize("cipher", CIPHERS)
def test_records_round_trip_across_key_rolls(cipher):
    sealer = RecordSealer(KEY, cipher, rekey_interval=3)
    reader = RecordReader(KEY, cipher, rekey_interval=3)
    plaintexts = [bytes([i]) * (i + 1) for i in range(10)]
    reader.receive_data(sealer.seal_many(plaintexts))
    got = []
    while (record := reader.next_record()) is not None:
        got.append(bytes(record))
    assert got == plaintexts


@pytest.mark.parametrize("cipher", CIPHERS)
def test_big_head_body_frames_seal_as_their_concatenation_across_key_rolls(cipher):
    # Bodies from 64 KiB up are sealed in pieces where the cipher allows it (AES-GCM):
    # the records must be byte for byte those of the concatenated plaintexts.
    bodies = [bytes([i]) * size for i, size in enumerate([65535, 65536, 300_001, 10, 1 << 18])]
    pairs = [(bytes([0, i, 0, 0, i]), memoryview(b)) for i, b in enumerate(bodies)]
    joined = RecordSealer(KEY, cipher, rekey_interval=2).seal_many([h + b for h, b in pairs])
    sealer = RecordSealer(KEY, cipher, rekey_interval=2)
    out = bytearray(sealer.sealed_size(pairs))
    assert sealer.seal_into(pairs, out) == len(joined) and out == joined
    reader = RecordReader(KEY, cipher, rekey_interval=2)
    reader.receive_data(out)
    got = []
    while (record := reader.next_record()) is not None:
        got.append(bytes(record))
    assert got == [h + b for h, b in pairs]


@pytest.mark.parametrize("cipher", CIPHERS)
def test_a_reader_that_does_not_roll_its_key_fails_after_the_roll(cipher):
    sealer = RecordSealer(KEY, cipher, rekey_interval=2)
    reader = RecordReader(KEY, cipher, rekey_interval=1 << 20)
    reader.receive_data(sealer.seal_many([b"a", b"b", b"c"]))
    assert reader.next_record() == b"a" and reader.next_record() == b"b"
    with pytest.raises(ProtocolError, match="authentication"):
        reader.next_record()


def test_rekey_gives_a_new_key_per_cipher():
    assert rekey(CHACHAPOLY, KEY) != KEY
    assert rekey(AESGCM_256, KEY) != rekey(CHACHAPOLY, KEY)
    assert rekey(AESGCM_256, KEY) == rekey(AESGCM_256, KEY)


def test_records_sealed_with_one_cipher_do_not_open_with_the_other():
    wire = RecordSealer(KEY, AESGCM_256).seal(b"hello")
    reader = RecordReader(KEY, CHACHAPOLY)
    reader.receive_data(wire)
    with pytest.raises(ProtocolError):
        reader.next_record()


def test_choose_takes_the_initiators_first_cipher_we_support():
    assert choose([AESGCM_256, CHACHAPOLY], (AESGCM_256, CHACHAPOLY)) == AESGCM_256
    assert choose([AESGCM_256, CHACHAPOLY], (CHACHAPOLY,)) == CHACHAPOLY
    assert choose([CHACHAPOLY, AESGCM_256], (AESGCM_256, CHACHAPOLY)) == CHACHAPOLY
    assert choose(["rot13", 7], (AESGCM_256, CHACHAPOLY)) == CHACHAPOLY
    assert choose([], (AESGCM_256, CHACHAPOLY)) == CHACHAPOLY


def test_this_machine_always_offers_chachapoly():
    assert CHACHAPOLY in preferred()
    assert set(preferred()) <= set(CIPHERS)


@pytest.mark.parametrize(
    ("initiator", "responder", "expected"),
    [
        ((AESGCM_256, CHACHAPOLY), (AESGCM_256, CHACHAPOLY), AESGCM_256),
        ((AESGCM_256, CHACHAPOLY), (CHACHAPOLY,), CHACHAPOLY),
        ((CHACHAPOLY,), (AESGCM_256, CHACHAPOLY), CHACHAPOLY),
    ],
)
def test_handshake_negotiates_the_record_cipher(initiator, responder, expected):
    a, b = peer(record_ciphers=initiator), peer(record_ciphers=responder)
    ri, rr, _ = run_handshake(Handshake(a, initiator=True), Handshake(b, initiator=False))
    assert ri.cipher == rr.cipher == expected
    sealer = RecordSealer(ri.send_key, ri.cipher)
    reader = RecordReader(rr.recv_key, rr.cipher)
    reader.receive_data(sealer.seal(b"both ends agree"))
    assert reader.next_record() == b"both ends agree"
