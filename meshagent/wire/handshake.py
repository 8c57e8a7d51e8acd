"""The overlay handshake, sans-IO: Noise XX with the mesh secret as PSK, identities bound by
ed25519 signatures, protocol version negotiated.

Wire form: three Noise messages, each prefixed by a 2-byte big-endian length.
  1. initiator -> responder: e, psk          payload {0: 1, 1: [min_version, max_version],
                                                      8: [record ciphers offered]}
  2. responder -> initiator: e, ee, s, es    payload identity (below), chosen version,
                                             8: chosen record cipher
  3. initiator -> responder: s, se           payload identity, echoed version
Identity payload: {0: 1, 2: version, 3: ed25519 public key, 4: signature, 5: peer id,
6: stream settings, 7: incarnation}. The signature is ed25519 over
STATIC_KEY_CONTEXT + the sender's Noise static public key.
A responder that cannot accept message 1 may answer with a refusal instead of message 2:
a zero length, a reason byte and its version range (see Refusal).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from enum import Enum, IntEnum, auto

import cbor2
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey
from noise.connection import Keypair, NoiseConnection

from meshagent.identity.keys import NodeIdentity, peer_id_for
from meshagent.identity.mesh import MeshSecret
from meshagent.wire import ciphers
from meshagent.wire.errors import HandshakeError, LocalUsageError
from meshagent.wire.quoted import quoted
from meshagent.wire.replay import ReplayGuard
from meshagent.wire.settings import StreamSettings

NOISE_PROTOCOL = b"Noise_XXpsk0_25519_ChaChaPoly_SHA256"
PROLOGUE = b"meshagent/overlay"
STATIC_KEY_CONTEXT = b"meshagent/noise-static-key/v1:"
PSK_PURPOSE = b"noise-psk/v1"
SUPPORTED_VERSIONS = (1, 1)
MAX_HANDSHAKE_MESSAGE = 4096
_PAYLOAD_FORMAT = 1
_LEN = struct.Struct(">H")
# A refusal: a zero length (never a valid message), a reason, the responder's versions.
_REFUSAL = struct.Struct(">HBHH")


class Refusal(IntEnum):
    """Why a responder refused message 1. Sent unauthenticated (nothing is shared yet), so
    the initiator uses it only to word its error and to stop retrying, never to trust."""

    NOT_A_MEMBER = 1
    NO_COMMON_VERSION = 2
    REPLAYED = 3


@dataclass(frozen=True, repr=False)
class LocalPeer:
    """This node's side of every handshake: identity, mesh, a Noise static key bound to the
    identity by signature, the stream settings it grants, and a per-process incarnation."""

    identity: NodeIdentity
    mesh: MeshSecret
    static_private: bytes
    static_public: bytes
    static_signature: bytes
    settings: StreamSettings = field(default_factory=StreamSettings)
    versions: tuple[int, int] = SUPPORTED_VERSIONS
    incarnation: bytes = field(default_factory=lambda: os.urandom(8))
    # Record ciphers offered, fastest first; ChaCha20-Poly1305 is always accepted.
    ciphers: tuple[str, ...] = field(default_factory=ciphers.preferred)

    @classmethod
    def create(
        cls,
        identity: NodeIdentity,
        mesh: MeshSecret,
        *,
        settings: StreamSettings | None = None,
        versions: tuple[int, int] = SUPPORTED_VERSIONS,
        record_ciphers: tuple[str, ...] | None = None,
    ) -> LocalPeer:
        key = X25519PrivateKey.generate()
        static_public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return cls(
            identity=identity,
            mesh=mesh,
            static_private=key.private_bytes_raw(),
            static_public=static_public,
            static_signature=identity.sign(STATIC_KEY_CONTEXT + static_public),
            settings=settings or StreamSettings(),
            versions=versions,
            ciphers=ciphers.preferred() if record_ciphers is None else record_ciphers,
        )

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def __repr__(self) -> str:
        return f"LocalPeer(peer_id={self.peer_id!r}, mesh={self.mesh.fingerprint!r})"


@dataclass(frozen=True, repr=False)
class HandshakeResult:
    """What a completed handshake established: who the peer is, and the session keys."""

    initiator: bool
    peer_id: str
    public_key: bytes
    version: int
    send_key: bytes
    recv_key: bytes
    handshake_hash: bytes
    remote_settings: StreamSettings
    remote_incarnation: bytes
    cipher: str = ciphers.CHACHAPOLY

    @property
    def session_id(self) -> str:
        """Identical on both ends of one connection; different for every connection."""
        return self.handshake_hash[:8].hex()

    def __repr__(self) -> str:
        return (
            f"HandshakeResult(peer_id={self.peer_id!r}, version={self.version}, "
            f"session={self.session_id})"
        )


class _State(Enum):
    START = auto()
    AWAIT_MSG1 = auto()
    AWAIT_MSG2 = auto()
    AWAIT_MSG3 = auto()
    DONE = auto()
    FAILED = auto()


class Handshake:
    """One side of one handshake. Feed received bytes to `receive_data`, send what it returns.

    Any failure raises HandshakeError and leaves the handshake FAILED; the caller closes the
    transport. No data is ever exchanged in the clear after message 1's ephemeral key.
    """

    def __init__(
        self,
        local: LocalPeer,
        *,
        initiator: bool,
        expected_peer_id: str | None = None,
        replay_guard: ReplayGuard | None = None,
    ) -> None:
        self._local = local
        self._initiator = initiator
        self._expected = expected_peer_id
        self._replay_guard = replay_guard
        self._buffer = bytearray()
        self._state = _State.START
        self._version = 0
        self._cipher = ciphers.CHACHAPOLY
        self._result: HandshakeResult | None = None
        self.refusal = b""  # bytes to send the initiator before closing, when we refuse it
        noise = NoiseConnection.from_name(NOISE_PROTOCOL)
        noise.set_psks(psk=local.mesh.derive(PSK_PURPOSE))
        noise.set_prologue(PROLOGUE)
        noise.set_keypair_from_private_bytes(Keypair.STATIC, local.static_private)
        if initiator:
            noise.set_as_initiator()
        else:
            noise.set_as_responder()
        noise.start_handshake()
        self._noise = noise
        # noiseprotocol drops its handshake state (and the remote static key) when it
        # finishes; keep a reference to read the peer's static key after the last message.
        self._hs_state = noise.noise_protocol.handshake_state

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    @property
    def result(self) -> HandshakeResult:
        if self._result is None:
            raise LocalUsageError("the handshake has not completed")
        return self._result

    def trailing_data(self) -> bytes:
        """Bytes received after the last handshake message: the start of the record stream."""
        data = bytes(self._buffer)
        self._buffer.clear()
        return data

    def start(self) -> bytes:
        """The initiator's first message; empty for the responder, which speaks second."""
        if self._state is not _State.START:
            raise LocalUsageError("Handshake.start() called twice")
        if not self._initiator:
            self._state = _State.AWAIT_MSG1
            return b""
        lo, hi = self._local.versions
        payload = cbor2.dumps({0: _PAYLOAD_FORMAT, 1: [lo, hi], 8: list(self._local.ciphers)})
        message = bytes(self._noise.write_message(payload))
        self._state = _State.AWAIT_MSG2
        return _LEN.pack(len(message)) + message

    def receive_data(self, data: bytes) -> bytes:
        """Consume handshake bytes; return bytes to send (maybe empty). Raises HandshakeError."""
        if self._state in (_State.START, _State.FAILED):
            raise LocalUsageError(f"Handshake.receive_data() in state {self._state.name}")
        if self._state is _State.DONE:
            self._buffer += data
            return b""
        self._buffer += data
        out = bytearray()
        while self._state not in (_State.DONE, _State.FAILED):
            message = self._next_message()
            if message is None:
                break
            try:
                out += self._step(message)
            except HandshakeError:
                self._state = _State.FAILED
                raise
        return bytes(out)

    def _next_message(self) -> bytes | None:
        if len(self._buffer) < 2:
            return None
        (length,) = _LEN.unpack_from(self._buffer)
        if length == 0 and self._state is _State.AWAIT_MSG2:
            if len(self._buffer) < _REFUSAL.size:
                return None
            self._state = _State.FAILED
            raise HandshakeError(self._describe_refusal(*_REFUSAL.unpack_from(self._buffer)[1:]))
        if length > MAX_HANDSHAKE_MESSAGE or length < 32:
            self._state = _State.FAILED
            raise HandshakeError(
                f"handshake message of {length} bytes is outside 32-{MAX_HANDSHAKE_MESSAGE}: "
                "the peer is not speaking the meshagent overlay protocol (plaintext?)"
            )
        if len(self._buffer) < 2 + length:
            return None
        message = bytes(self._buffer[2 : 2 + length])
        del self._buffer[: 2 + length]
        return message

    def _step(self, message: bytes) -> bytes:
        if self._state is _State.AWAIT_MSG1:
            return self._on_msg1(message)
        if self._state is _State.AWAIT_MSG2:
            return self._on_msg2(message)
        return self._on_msg3(message)

    def _read(self, message: bytes, failure: str) -> dict:
        try:
            payload = bytes(self._noise.read_message(message))
        except Exception as e:  # noiseprotocol/cryptography raise assorted types on bad input
            raise HandshakeError(failure) from e
        try:
            body = cbor2.loads(payload)
        except Exception as e:
            raise HandshakeError("handshake payload is not valid CBOR") from e
        if not isinstance(body, dict) or body.get(0) != _PAYLOAD_FORMAT:
            raise HandshakeError("handshake payload has an unknown format")
        return body

    def _identity_payload(self) -> bytes:
        local = self._local
        return cbor2.dumps(
            {
                0: _PAYLOAD_FORMAT,
                2: self._version,
                3: local.identity.public_key,
                4: local.static_signature,
                5: local.peer_id,
                6: local.settings.to_cbor(),
                7: local.incarnation,
                8: self._cipher,
            }
        )

    def _refuse(self, reason: Refusal, message: str) -> HandshakeError:
        lo, hi = self._local.versions
        self.refusal = _REFUSAL.pack(0, reason, lo, hi)
        return HandshakeError(message)

    def _describe_refusal(self, reason: int, lo: int, hi: int) -> str:
        if reason == Refusal.NOT_A_MEMBER:
            return (
                "the responder refused us: it is not in our mesh (it has a different mesh "
                "secret; check the invite)"
            )
        if reason == Refusal.NO_COMMON_VERSION:
            mine = self._local.versions
            return (
                f"no common protocol version: the responder speaks {lo}-{hi}, we speak "
                f"{mine[0]}-{mine[1]}; upgrade one side"
            )
        if reason == Refusal.REPLAYED:
            return "the responder refused our first message as a replay"
        return f"the responder refused the handshake (reason {reason})"

    def _on_msg1(self, message: bytes) -> bytes:
        try:
            return self._answer_msg1(message)
        except HandshakeError as e:
            if not self.refusal:
                self._refuse(Refusal.NOT_A_MEMBER, str(e))
            raise

    def _answer_msg1(self, message: bytes) -> bytes:
        body = self._read(
            message,
            "the peer is not a member of this mesh (wrong mesh secret) or its first handshake "
            "message is corrupt",
        )
        if self._replay_guard is not None and not self._replay_guard.check_and_remember(message):
            raise self._refuse(
                Refusal.REPLAYED, "replayed handshake: this first message was seen before"
            )
        offered = body.get(1)
        if (
            not isinstance(offered, list)
            or len(offered) != 2
            or not all(type(v) is int for v in offered)
        ):
            raise HandshakeError("initiator's protocol version range is malformed")
        lo = max(offered[0], self._local.versions[0])
        hi = min(offered[1], self._local.versions[1])
        if lo > hi:
            theirs = f"{quoted(offered[0])}-{quoted(offered[1])}"
            raise self._refuse(
                Refusal.NO_COMMON_VERSION,
                f"no common protocol version: peer speaks {theirs}, "
                f"we speak {self._local.versions[0]}-{self._local.versions[1]}; upgrade one side",
            )
        self._version = hi
        offered_ciphers = body.get(8, [])
        if not isinstance(offered_ciphers, list):
            raise HandshakeError("initiator's record cipher list is malformed")
        self._cipher = ciphers.choose(offered_ciphers, (*self._local.ciphers, ciphers.CHACHAPOLY))
        reply = bytes(self._noise.write_message(self._identity_payload()))
        self._state = _State.AWAIT_MSG3
        return _LEN.pack(len(reply)) + reply

    def _on_msg2(self, message: bytes) -> bytes:
        body = self._read(
            message,
            "the responder is not a member of this mesh (wrong mesh secret) or its handshake "
            "reply is corrupt",
        )
        version = body.get(2)
        lo, hi = self._local.versions
        if type(version) is not int or not lo <= version <= hi:
            raise HandshakeError(
                f"responder chose protocol version {quoted(version)}, outside {lo}-{hi}"
            )
        self._version = version
        cipher = body.get(8, ciphers.CHACHAPOLY)
        if cipher != ciphers.CHACHAPOLY and cipher not in self._local.ciphers:
            raise HandshakeError(
                f"responder chose record cipher {quoted(cipher)}, which we did not offer"
            )
        self._cipher = cipher
        identity = self._verify_identity(body)
        if self._expected is not None and identity[0] != self._expected:
            raise HandshakeError(
                f"dialed peer {self._expected} but reached {identity[0]}; the address now "
                "belongs to another peer"
            )
        reply = bytes(self._noise.write_message(self._identity_payload()))
        self._finish(identity)
        return _LEN.pack(len(reply)) + reply

    def _on_msg3(self, message: bytes) -> bytes:
        body = self._read(
            message,
            "the final handshake message failed authentication (replayed or tampered handshake)",
        )
        if body.get(2) != self._version:
            raise HandshakeError("initiator did not confirm the negotiated protocol version")
        self._finish(self._verify_identity(body))
        return b""

    def _verify_identity(self, body: dict) -> tuple[str, bytes, StreamSettings, bytes]:
        public_key, signature, peer_id = body.get(3), body.get(4), body.get(5)
        incarnation = body.get(7)
        if not (
            isinstance(public_key, bytes)
            and len(public_key) == 32
            and isinstance(signature, bytes)
            and len(signature) == 64
            and isinstance(peer_id, str)
            and isinstance(incarnation, bytes)
            and len(incarnation) <= 32
        ):
            raise HandshakeError("peer identity payload is malformed")
        if peer_id_for(public_key) != peer_id:
            raise HandshakeError(
                f"peer claims id {quoted(peer_id, 80)} which does not match its public key"
            )
        remote_static = self._hs_state.rs.public_bytes
        try:
            VerifyKey(public_key).verify(STATIC_KEY_CONTEXT + remote_static, signature)
        except (BadSignatureError, ValueError) as e:
            raise HandshakeError(
                f"peer {peer_id} did not prove its Noise key belongs to its identity "
                "(bad signature)"
            ) from e
        return peer_id, public_key, StreamSettings.from_cbor(body.get(6)), incarnation

    def _finish(self, identity: tuple[str, bytes, StreamSettings, bytes]) -> None:
        if not self._noise.handshake_finished:
            raise HandshakeError("handshake ended early")  # cannot happen with XX; be explicit
        proto = self._noise.noise_protocol
        peer_id, public_key, settings, incarnation = identity
        self._result = HandshakeResult(
            initiator=self._initiator,
            peer_id=peer_id,
            public_key=public_key,
            version=self._version,
            send_key=bytes(proto.cipher_state_encrypt.k),
            recv_key=bytes(proto.cipher_state_decrypt.k),
            handshake_hash=bytes(self._noise.get_handshake_hash()),
            remote_settings=settings,
            remote_incarnation=incarnation,
            cipher=self._cipher,
        )
        self._state = _State.DONE
