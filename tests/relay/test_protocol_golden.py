"""Relay framing on the wire: bytes captured from the framer before it moved onto
`meshagent.wire.framing` (old and new agents and relays must understand each other)."""

from __future__ import annotations

import pytest
import trio
from nacl.signing import SigningKey

from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret
from meshagent.relay import client, server
from meshagent.relay import protocol as p
from meshagent.relay.errors import Refusal, RelayError, RelayProtocolError
from meshagent.wire.framing import LengthPrefixDecoder
from tests.net.scripted import ScriptedStream

IDENTITY = NodeIdentity(SigningKey(bytes(range(32))))
NONCE = bytes(range(100, 132))
MESH = MeshSecret(b"\x07" * 32)

# Produced by the old code from the messages in MESSAGES, in that order.
RELAY_HELLO = bytes.fromhex(
    "0031a4000101010258206465666768696a6b6c6d6e6f707172737475767778797a7b7c7d7e7f808182830367"
    "72656c61792d31"
)
RELAY_REGISTER = bytes.fromhex(
    "008ea50001010202582003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b80358"
    "407165a80aaae6f6fe3e90a0cb5992542c8844121c36b6d1e0c785f6988862731a519b163d07acd3bd1cf5df"
    "51faa44df8fb4136f7e7c341073513499992752d04045820ccf50b91d328619cf1ac23d7107c54a653ae64cc"
    "0208e55ee5c21c4fcac96707"
)
RELAY_CONNECT = bytes.fromhex(
    "0078a50001010302582003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b80358"
    "406464cb76d6e0b92dfc608bd697b886e2ee08c6c808653ddd61343f1e72ee4d55e4e27fe9f2391f1f5f4f1f"
    "793831f60eebe4896f0aef357517b162bf5a287a04044b7461726765742d70656572"
)
RELAY_ACCEPT = bytes.fromhex(
    "007da50001010402582003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b80358"
    "4022287dc79e7035d4a86eb9f49a6a6cc5a8043e51079c5c7124d92db4ebce382495d40fbc6deb69e227520b"
    "8df7af3809eb33d6fef07546ac4dc85404affd340d045001010101010101010101010101010101"
)
RELAY_REGISTERED = bytes.fromhex("0015a300010105028266706565722d6266706565722d63")
RELAY_MEMBERS = bytes.fromhex("000ea300010106028166706565722d62")
RELAY_INCOMING = bytes.fromhex("001fa4000101070250020202020202020202020202020202020366706565722d62")
RELAY_SPLICED = bytes.fromhex("000da3000101080266706565722d62")
RELAY_REFUSED = bytes.fromhex("001aa40001010902050371746f6f206d616e79206369726375697473")
RELAY_PING = bytes.fromhex("0005a20001010a")
RELAY_PONG = bytes.fromhex("0005a20001010b")

MESSAGES = [
    (p.hello(NONCE, "relay-1"), RELAY_HELLO),
    (p.register(IDENTITY, NONCE, p.rendezvous_tag(MESH)), RELAY_REGISTER),
    (p.connect(IDENTITY, NONCE, "target-peer"), RELAY_CONNECT),
    (p.accept(IDENTITY, NONCE, b"\x01" * 16), RELAY_ACCEPT),
    (p.registered(["peer-b", "peer-c"]), RELAY_REGISTERED),
    (p.members(["peer-b"]), RELAY_MEMBERS),
    (p.incoming(b"\x02" * 16, "peer-b"), RELAY_INCOMING),
    (p.spliced("peer-b"), RELAY_SPLICED),
    (p.refused(Refusal.CIRCUIT_LIMIT, "too many circuits"), RELAY_REFUSED),
    (p.Message(p.PING), RELAY_PING),
    (p.Message(p.PONG), RELAY_PONG),
]


@pytest.mark.parametrize(("msg", "old"), MESSAGES, ids=lambda v: getattr(v, "name", ""))
def test_messages_are_framed_as_before(msg, old):
    assert msg.encode() == old


def test_old_messages_decode_byte_by_byte_and_old_signatures_verify():
    frames = LengthPrefixDecoder(p.FRAMING)
    got = []
    for byte in b"".join(old for _, old in MESSAGES):
        frames.feed(bytes([byte]))
        if (body := frames.next_frame()) is not None:
            got.append(p.decode(body))
    assert got == [msg for msg, _ in MESSAGES]
    assert p.verify_request(got[1], NONCE) == (IDENTITY.peer_id, p.rendezvous_tag(MESH))


def test_bytes_behind_spliced_belong_to_the_splice():
    frames = LengthPrefixDecoder(p.FRAMING, RELAY_SPLICED + b"\x00\x20noise handshake")
    assert p.decode(frames.next_frame()).type == p.SPLICED
    assert frames.leftover() == b"\x00\x20noise handshake"


def test_an_oversize_message_is_a_relay_protocol_error_both_ways():
    with pytest.raises(
        RelayProtocolError, match="relay message of 16389 bytes is over the 16384-byte limit"
    ):
        p.Message(p.HELLO, {2: b"x" * 16380}).encode()
    frames = LengthPrefixDecoder(p.FRAMING, (p.MAX_MESSAGE + 1).to_bytes(2, "big"))
    with pytest.raises(RelayProtocolError, match="16385 bytes is over the 16384-byte limit"):
        frames.next_frame()


async def test_each_side_reports_a_closed_connection_as_before():
    half = RELAY_HELLO[:7]
    with pytest.raises(trio.BrokenResourceError, match="the client closed the connection"):
        await server._read_message(ScriptedStream(half), LengthPrefixDecoder(p.FRAMING))
    with pytest.raises(RelayError, match="the relay closed the connection"):
        await client._read_message(ScriptedStream(half), LengthPrefixDecoder(p.FRAMING))
    msg = await client._read_message(
        ScriptedStream(half, RELAY_HELLO[7:]), LengthPrefixDecoder(p.FRAMING)
    )
    assert msg == p.hello(NONCE, "relay-1")
