"""The relay protocol, sans-IO: messages, their framing, and the signatures that tie each
request to an agent's identity.

Every TCP connection to a relay starts with the relay's HELLO (a fresh random nonce, and the
address the relay sees the connection come from: behind a NAT, the agent's public address).
The client's first message says what the connection is for, signed with its ed25519 key
over a context string, the nonce, the message type and its subject:

    REGISTER  subject = rendezvous tag   the control connection of an agent
    CONNECT   subject = target peer id   a circuit to another agent (the dialer's end)
    ACCEPT    subject = circuit id       the target's end of a circuit it was offered

The rendezvous tag is derived from the mesh secret (`rendezvous_tag`), so the relay can
group the members of a mesh without learning the secret, and outsiders cannot compute it
(unlike the public mesh fingerprint). On a control connection the relay answers REGISTERED
and then pushes MEMBERS (peer ids in the same mesh) and INCOMING (a circuit is waiting for
you); the client sends PING, answered with PONG. A CONNECT or ACCEPT is answered with
SPLICED, after which the connection carries only the two agents' bytes (their overlay
handshake and encrypted records: the relay never sees plaintext), or with REFUSED.

Framing: `u16 length || CBOR map {0: version, 1: type, ...}`, at most 16 KiB (`FRAMING`;
read with a `LengthPrefixDecoder`, whose `leftover()` after SPLICED belongs to the splice).
A relay faces anyone on the network and a client faces a relay it does not control: `decode`
takes only version 1 and a known type, and each field is read through this module
(`Message.get`, `verify_request`, `hello_nonce`, `peer_list`, `incoming_circuit`,
`raise_if_refused`), which checks its type and size. Anything else is a RelayError that
names the field and its value, and ends that connection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import cbor2
from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

from meshagent.errors import ConfigError
from meshagent.identity.keys import NodeIdentity, peer_id_for
from meshagent.identity.mesh import MeshSecret
from meshagent.net.address import Address
from meshagent.relay.errors import Refusal, RelayProtocolError, RelayRefused
from meshagent.wire.framing import Framing
from meshagent.wire.quoted import quoted

VERSION = 1
MAX_MESSAGE = 16 * 1024
NONCE_LEN = 32
FRAMING = Framing("relay message", width=2, max_size=MAX_MESSAGE, error=RelayProtocolError)
_CONTEXT = b"meshagent/relay-request/v1\x00"

HELLO, REGISTER, CONNECT, ACCEPT = 1, 2, 3, 4
REGISTERED, MEMBERS, INCOMING, SPLICED, REFUSED, PING, PONG = 5, 6, 7, 8, 9, 10, 11
_NAMES = {
    HELLO: "HELLO",
    REGISTER: "REGISTER",
    CONNECT: "CONNECT",
    ACCEPT: "ACCEPT",
    REGISTERED: "REGISTERED",
    MEMBERS: "MEMBERS",
    INCOMING: "INCOMING",
    SPLICED: "SPLICED",
    REFUSED: "REFUSED",
    PING: "PING",
    PONG: "PONG",
}
MAX_MEMBERS_LISTED = 1024
MAX_PEER_ID = 64  # characters of a peer id a relay names
MAX_SUBJECT = 256  # bytes of a request's subject
CIRCUIT_LEN = 16
MAX_ADDRESS = 64  # characters of an observed host:port


def rendezvous_tag(mesh: MeshSecret) -> bytes:
    """What a relay groups a mesh's members by: a key derived from the secret."""
    return mesh.derive(b"relay-rendezvous/v1")


@dataclass(frozen=True)
class Message:
    """One relay message: `type` and its fields (CBOR integer keys >= 2)."""

    type: int
    fields: dict[int, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return _NAMES.get(self.type, str(self.type))

    def encode(self) -> bytes:
        data = cbor2.dumps({0: VERSION, 1: self.type, **self.fields})
        FRAMING.check(len(data))  # the other side would refuse it
        return FRAMING.encode(data)

    def get(self, key: int, kind: type, *, size: int | None = None, most: int | None = None) -> Any:
        """Field `key`, a `kind` (a bool is no int), `size` long or at most `most` long;
        RelayProtocolError naming the field and its value otherwise."""
        v = self.fields.get(key)
        if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
            raise RelayProtocolError(
                f"{self.name} field {key} must be a {kind.__name__}, not {quoted(v)}"
            )
        if size is not None and len(v) != size:
            raise RelayProtocolError(f"{self.name} field {key} must be {size} long, not {len(v)}")
        if most is not None and len(v) > most:
            raise RelayProtocolError(
                f"{self.name} field {key} must be at most {most} long, not {len(v)}"
            )
        return v


def decode(data: bytes) -> Message:
    """A message of this version and a known type (RelayRefused(VERSION) for another
    version, RelayProtocolError for the rest); its fields are read with `Message.get`."""
    try:
        d = cbor2.loads(data)
    except Exception as e:  # cbor2 raises several unrelated types on garbage
        raise RelayProtocolError(f"relay message is not valid CBOR ({e})") from e
    if not isinstance(d, dict):
        raise RelayProtocolError(f"a relay message is a map, not {quoted(d)}")
    version, kind = d.get(0), d.get(1)
    if type(version) is not int or version != VERSION:  # True and 1.0 equal 1
        raise RelayRefused(
            Refusal.VERSION, f"relay protocol version {quoted(version)} not supported"
        )
    if type(kind) is not int or kind not in _NAMES:
        raise RelayProtocolError(
            f"relay message of type {quoted(kind)}, not one of {min(_NAMES)}-{max(_NAMES)}"
        )
    return Message(kind, {k: v for k, v in d.items() if type(k) is int and k >= 2})


# ----- messages -----


def hello(
    nonce: bytes, relay_name: str = "", *, observed: str = "", observe_port: int = 0
) -> Message:
    """`observed`: the address the relay sees this connection come from (host:port; the
    agent's public address where a NAT is between); `observe_port`: the relay's second port,
    which answers a HELLO and closes, for an agent to compare the address it is seen from
    there (whether its NAT maps by destination); 0: none."""
    fields: dict[int, Any] = {2: nonce, 3: relay_name}
    if observed:
        fields[4] = observed
    if observe_port:
        fields[5] = observe_port
    return Message(HELLO, fields)


def _signed(kind: int, identity: NodeIdentity, nonce: bytes, subject: bytes) -> Message:
    sig = identity.sign(_CONTEXT + nonce + bytes([kind]) + subject)
    return Message(kind, {2: identity.public_key, 3: sig, 4: subject})


def register(identity: NodeIdentity, nonce: bytes, tag: bytes) -> Message:
    return _signed(REGISTER, identity, nonce, tag)


def connect(identity: NodeIdentity, nonce: bytes, target: str) -> Message:
    return _signed(CONNECT, identity, nonce, target.encode())


def accept(identity: NodeIdentity, nonce: bytes, circuit: bytes) -> Message:
    return _signed(ACCEPT, identity, nonce, circuit)


def verify_request(msg: Message, nonce: bytes) -> tuple[str, bytes]:
    """Check a REGISTER/CONNECT/ACCEPT signature over this connection's nonce; returns
    (the signer's peer id, the subject). Raises RelayRefused(BAD_SIGNATURE)."""
    pk = msg.get(2, bytes, size=32)
    sig = msg.get(3, bytes, size=64)
    subject = msg.get(4, bytes, most=MAX_SUBJECT)
    try:
        VerifyKey(pk).verify(_CONTEXT + nonce + bytes([msg.type]) + subject, sig)
    except (BadSignatureError, ValueError) as e:
        raise RelayRefused(Refusal.BAD_SIGNATURE, "the request's signature does not verify") from e
    return peer_id_for(pk), subject


def registered(members: list[str]) -> Message:
    return Message(REGISTERED, {2: members[:MAX_MEMBERS_LISTED]})


def members(peers: list[str]) -> Message:
    return Message(MEMBERS, {2: peers[:MAX_MEMBERS_LISTED]})


def incoming(circuit: bytes, from_peer: str) -> Message:
    return Message(INCOMING, {2: circuit, 3: from_peer})


def spliced(peer: str) -> Message:
    return Message(SPLICED, {2: peer})


def refused(code: Refusal, reason: str) -> Message:
    return Message(REFUSED, {2: int(code), 3: reason[:512]})


_CODES = frozenset(int(c) for c in Refusal)


def raise_if_refused(msg: Message) -> None:
    """RelayRefused with the relay's code and reason if `msg` is a REFUSED; a code this
    side does not know is a RelayProtocolError naming it."""
    if msg.type == REFUSED:
        code = msg.fields.get(2)
        if type(code) is not int or code not in _CODES:
            raise RelayProtocolError(
                f"REFUSED with code {quoted(code)}, not one of {min(_CODES)}-{max(_CODES)}"
            )
        reason = msg.fields.get(3)
        raise RelayRefused(
            Refusal(code), reason[:512] if isinstance(reason, str) else "no reason given"
        )


def hello_nonce(msg: Message) -> bytes:
    """The nonce of a HELLO, which a request signs."""
    return msg.get(2, bytes, size=NONCE_LEN)


def hello_observed(msg: Message) -> Address | None:
    """The address a HELLO says the relay sees us from; None where it does not say."""
    if 4 not in msg.fields:
        return None
    text = msg.get(4, str, most=MAX_ADDRESS)
    try:
        return Address.parse(text)
    except ConfigError as e:
        raise RelayProtocolError(f"HELLO's observed address {quoted(text)} is not host:port") from e


def hello_observe_port(msg: Message) -> int:
    """The relay's observing port of a HELLO (0: none)."""
    if 5 not in msg.fields:
        return 0
    port = msg.get(5, int)
    if not 0 < port < 65536:
        raise RelayProtocolError(f"HELLO's observe port {quoted(port)} is not 1-65535")
    return port


def peer_list(msg: Message) -> list[str]:
    """The peer ids of a REGISTERED or MEMBERS."""
    v = msg.get(2, list, most=MAX_MEMBERS_LISTED)
    for peer in v:
        if not isinstance(peer, str) or len(peer) > MAX_PEER_ID:
            raise RelayProtocolError(
                f"{msg.name} lists {quoted(peer)}, not a peer id of at most {MAX_PEER_ID} "
                "characters"
            )
    return v


def incoming_circuit(msg: Message) -> tuple[bytes, str]:
    """The circuit id of an INCOMING and the peer that opened it."""
    return msg.get(2, bytes, size=CIRCUIT_LEN), msg.get(3, str, most=MAX_PEER_ID)
