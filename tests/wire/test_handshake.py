import contextlib
import dataclasses

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.identity.mesh import MeshSecret
from meshagent.wire.errors import HandshakeError, ProtocolError
from meshagent.wire.handshake import Handshake
from meshagent.wire.replay import ReplayGuard
from meshagent.wire.settings import StreamSettings
from tests.wire.pairs import peer, run_handshake

A = peer()
B = peer()


def test_same_mesh_handshake_authenticates_both_sides():
    ri, rr, _ = run_handshake(Handshake(A, initiator=True), Handshake(B, initiator=False))
    assert ri.peer_id == B.peer_id and rr.peer_id == A.peer_id
    assert ri.public_key == B.identity.public_key and rr.public_key == A.identity.public_key
    assert ri.send_key == rr.recv_key and ri.recv_key == rr.send_key
    assert ri.send_key != ri.recv_key
    assert ri.session_id == rr.session_id
    assert ri.version == rr.version == 1
    assert ri.remote_settings == B.settings and rr.remote_settings == A.settings
    assert ri.remote_incarnation == B.incarnation
    assert "send_key" not in repr(ri) and ri.send_key.hex() not in repr(ri)


def test_each_handshake_has_fresh_keys():
    r1, _, _ = run_handshake(Handshake(A, initiator=True), Handshake(B, initiator=False))
    r2, _, _ = run_handshake(Handshake(A, initiator=True), Handshake(B, initiator=False))
    assert r1.send_key != r2.send_key and r1.session_id != r2.session_id


def test_peer_without_the_mesh_secret_is_refused_at_the_first_message():
    outsider = peer(MeshSecret(b"\x08" * 32))
    initiator, responder = Handshake(outsider, initiator=True), Handshake(B, initiator=False)
    responder.start()
    with pytest.raises(HandshakeError, match="not a member of this mesh"):
        responder.receive_data(initiator.start())


def test_initiator_refuses_a_reply_from_another_mesh():
    other = MeshSecret(b"\x08" * 32)
    outsider_i, outsider_r = (
        Handshake(peer(other), initiator=True),
        Handshake(peer(other), initiator=False),
    )
    outsider_r.start()
    foreign_reply = outsider_r.receive_data(outsider_i.start())
    honest = Handshake(A, initiator=True)
    honest.start()
    with pytest.raises(HandshakeError, match="not a member of this mesh"):
        honest.receive_data(foreign_reply)
    assert not honest.done


def test_initiator_can_require_the_expected_peer():
    initiator = Handshake(A, initiator=True, expected_peer_id=peer().peer_id)
    responder = Handshake(B, initiator=False)
    responder.start()
    msg2 = responder.receive_data(initiator.start())
    with pytest.raises(HandshakeError, match=r"dialed peer .* but reached"):
        initiator.receive_data(msg2)


def test_expected_peer_id_that_matches_is_accepted():
    initiator = Handshake(A, initiator=True, expected_peer_id=B.peer_id)
    ri, _, _ = run_handshake(initiator, Handshake(B, initiator=False))
    assert ri.peer_id == B.peer_id


def test_version_negotiation_picks_the_highest_common_version():
    new = dataclasses.replace(A, versions=(1, 3))
    newer = dataclasses.replace(B, versions=(2, 5))
    ri, rr, _ = run_handshake(Handshake(new, initiator=True), Handshake(newer, initiator=False))
    assert ri.version == rr.version == 3


def test_no_common_version_is_refused_with_a_clear_error():
    old = dataclasses.replace(A, versions=(1, 1))
    new = dataclasses.replace(B, versions=(2, 2))
    initiator, responder = Handshake(old, initiator=True), Handshake(new, initiator=False)
    responder.start()
    with pytest.raises(HandshakeError, match="no common protocol version"):
        responder.receive_data(initiator.start())


def test_static_key_not_signed_by_the_identity_is_refused():
    forger = dataclasses.replace(B, static_signature=peer().static_signature)
    initiator, responder = Handshake(A, initiator=True), Handshake(forger, initiator=False)
    responder.start()
    msg2 = responder.receive_data(initiator.start())
    with pytest.raises(HandshakeError, match="bad signature"):
        initiator.receive_data(msg2)


def test_claimed_peer_id_must_match_the_public_key():
    class Liar(Handshake):
        def _identity_payload(self) -> bytes:
            import cbor2

            body = cbor2.loads(super()._identity_payload())
            body[5] = peer().peer_id
            return cbor2.dumps(body)

    initiator, responder = Handshake(A, initiator=True), Liar(B, initiator=False)
    responder.start()
    with pytest.raises(HandshakeError, match="does not match its public key"):
        initiator.receive_data(responder.receive_data(initiator.start()))


def test_replayed_handshake_is_refused():
    guard = ReplayGuard()
    _, _, messages = run_handshake(
        Handshake(A, initiator=True), Handshake(B, initiator=False, replay_guard=guard)
    )
    victim = Handshake(B, initiator=False, replay_guard=guard)
    victim.start()
    with pytest.raises(HandshakeError, match="replayed"):
        victim.receive_data(messages[0])


def test_replay_fails_even_without_the_guard():
    _, _, messages = run_handshake(Handshake(A, initiator=True), Handshake(B, initiator=False))
    victim = Handshake(B, initiator=False)
    victim.start()
    victim.receive_data(messages[0])  # message 1 alone proves nothing
    with pytest.raises(HandshakeError, match="replayed or tampered"):
        victim.receive_data(messages[2])
    assert not victim.done


@pytest.mark.parametrize("index", [0, 1, 2])
def test_tampered_handshake_message_is_refused(index):
    initiator, responder = Handshake(A, initiator=True), Handshake(B, initiator=False)
    msgs = [initiator.start()]
    responder.start()
    sides = [responder, initiator, responder]
    for i in range(3):
        msg = msgs[i]
        if i == index:
            msg = msg[:-5] + bytes([msg[-5] ^ 0x40]) + msg[-4:]
        if i == index:
            with pytest.raises(HandshakeError):
                sides[i].receive_data(msg)
            return
        msgs.append(sides[i].receive_data(msg))


def test_plaintext_speaker_is_refused():
    responder = Handshake(B, initiator=False)
    responder.start()
    with pytest.raises(HandshakeError, match="not speaking the meshagent overlay"):
        responder.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")


def test_messages_may_arrive_byte_by_byte_with_trailing_data():
    initiator, responder = Handshake(A, initiator=True), Handshake(B, initiator=False)
    responder.start()
    out = b""
    for byte in initiator.start():
        out += responder.receive_data(bytes([byte]))
    msg3 = initiator.receive_data(out)
    assert responder.receive_data(msg3 + b"records") == b""
    assert responder.done and responder.trailing_data() == b"records"


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600), st.booleans())
def test_arbitrary_bytes_raise_only_handshake_errors(data, as_initiator):
    hs = Handshake(A if as_initiator else B, initiator=as_initiator)
    hs.start()
    with contextlib.suppress(HandshakeError):
        hs.receive_data(data)
    assert not hs.done


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=1, max_size=300))
def test_garbage_after_a_valid_first_message_raises_only_protocol_errors(tail):
    initiator, responder = Handshake(A, initiator=True), Handshake(B, initiator=False)
    responder.start()
    msg2 = responder.receive_data(initiator.start())
    with contextlib.suppress(ProtocolError):
        initiator.receive_data(msg2[:2] + tail)


def test_refused_initiator_learns_why_and_does_not_hang():
    outsider = Handshake(peer(MeshSecret(b"\x08" * 32)), initiator=True)
    responder = Handshake(B, initiator=False)
    responder.start()
    with pytest.raises(HandshakeError):
        responder.receive_data(outsider.start())
    assert responder.refusal
    with pytest.raises(HandshakeError, match="different mesh secret"):
        outsider.receive_data(responder.refusal)


def test_version_refusal_names_both_ranges():
    old = Handshake(dataclasses.replace(A, versions=(1, 1)), initiator=True)
    new = Handshake(dataclasses.replace(B, versions=(2, 3)), initiator=False)
    new.start()
    with pytest.raises(HandshakeError):
        new.receive_data(old.start())
    with pytest.raises(HandshakeError, match="responder speaks 2-3, we speak 1-1"):
        old.receive_data(new.refusal)


# ----- a member's payload fields out of range, too wide to print ------------------------------

# Integers past the 4300 digits Python prints (a CBOR bignum of some 2 KB): quoted with repr()
# they raise ValueError, which no caller of a handshake catches.
huge = st.integers(4400, 5000).map(lambda n: 10**n)
wide = st.one_of(huge, huge.map(lambda v: -v))


class Tampering(Handshake):
    """A member's responder that puts `fields` into its reply (its own keys sign it)."""

    def __init__(self, *args, fields: dict, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields = fields

    def _identity_payload(self) -> bytes:
        return cbor2.dumps(cbor2.loads(super()._identity_payload()) | self.fields)


@settings(max_examples=30, deadline=None)
@given(wide, st.sampled_from([lambda v: (2, v), lambda v: (v, 0)]))
def test_a_version_range_out_of_range_is_refused_with_the_handshake_error(v, offer):
    initiator = Handshake(dataclasses.replace(A, versions=offer(v)), initiator=True)
    responder = Handshake(B, initiator=False)
    responder.start()
    with pytest.raises(HandshakeError, match="no common protocol version"):
        responder.receive_data(initiator.start())
    assert responder.refusal


@settings(max_examples=30, deadline=None)
@given(
    st.one_of(wide, st.integers(2**32, 2**70), st.integers(max_value=0)),
    st.sampled_from(
        [
            lambda v: {2: v},  # the version it chose
            lambda v: {8: v},  # the record cipher it chose
            lambda v: {6: StreamSettings().to_cbor() | {1: v}},  # its stream window
        ]
    ),
)
def test_a_reply_field_out_of_range_is_refused_with_the_handshake_error(v, field):
    initiator = Handshake(A, initiator=True)
    responder = Tampering(B, initiator=False, fields=field(v))
    responder.start()
    msg2 = responder.receive_data(initiator.start())
    with pytest.raises(HandshakeError):
        initiator.receive_data(msg2)
