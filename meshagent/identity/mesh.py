"""Mesh membership: the shared 32-byte mesh secret, its public fingerprint, and invite tokens.

Holding the secret is what makes a peer a member: the overlay handshake mixes a key derived
from it into Noise as a pre-shared key, so a peer without it cannot complete a handshake.
The fingerprint is a one-way hash of the secret, safe to show in `meshagent peers` or logs.
An invite carries the secret plus where to find the mesh, in a form a person can paste.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from dataclasses import dataclass

import cbor2

from meshagent.errors import MeshError

SECRET_LEN = 32
INVITE_PREFIX = "meshinv"
INVITE_VERSION = 1
_CHECKSUM_LEN = 4
_MAX_ADDRESSES = 64
_MAX_ADDRESS_LEN = 255


class InviteError(MeshError):
    """An invite token could not be read; the message says what to do."""


@dataclass(frozen=True, repr=False)
class MeshSecret:
    """The mesh secret. `repr` shows only the fingerprint so the secret never lands in logs."""

    value: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.value, bytes) or len(self.value) != SECRET_LEN:
            raise ValueError(f"a mesh secret is exactly {SECRET_LEN} bytes")

    @classmethod
    def generate(cls) -> MeshSecret:
        return cls(os.urandom(SECRET_LEN))

    @property
    def fingerprint(self) -> str:
        """A short public name for the mesh (26 base32 chars); reveals nothing of the secret."""
        return mesh_fingerprint(self)

    def derive(self, purpose: bytes) -> bytes:
        """A 32-byte key for one purpose, independent of keys for every other purpose."""
        return hmac.new(self.value, b"meshagent/mesh-key/" + purpose, hashlib.sha256).digest()

    def __repr__(self) -> str:
        return f"MeshSecret(fingerprint={self.fingerprint!r})"


def mesh_fingerprint(secret: MeshSecret) -> str:
    """One-way: sha256 over a domain tag and the secret, truncated to 128 bits, base32."""
    digest = hashlib.sha256(b"meshagent/mesh-fingerprint/v1\x00" + secret.value).digest()
    return base64.b32encode(digest[:16]).decode().rstrip("=").lower()


@dataclass(frozen=True)
class Invite:
    """Everything a new agent needs to join: the secret and where the mesh can be reached."""

    secret: MeshSecret
    bootstrap: tuple[str, ...] = ()
    relays: tuple[str, ...] = ()
    version: int = INVITE_VERSION

    def to_cbor(self) -> bytes:
        return cbor2.dumps(
            {0: self.version, 1: self.secret.value, 2: list(self.bootstrap), 3: list(self.relays)}
        )

    @classmethod
    def from_cbor(cls, data: bytes) -> Invite:
        try:
            body = cbor2.loads(data)
        except Exception as e:  # cbor2 raises several unrelated types on garbage
            raise InviteError(f"invite body is not valid CBOR ({e})") from e
        if not isinstance(body, dict) or body.get(0) != INVITE_VERSION:
            raise InviteError("invite body is malformed or of an unsupported version")
        secret = body.get(1)
        if not isinstance(secret, bytes) or len(secret) != SECRET_LEN:
            raise InviteError("invite does not carry a valid 32-byte mesh secret")
        return cls(
            secret=MeshSecret(secret),
            bootstrap=_addresses(body.get(2, []), "bootstrap"),
            relays=_addresses(body.get(3, []), "relay"),
        )


def _addresses(value: object, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > _MAX_ADDRESSES:
        raise InviteError(f"invite {what} addresses are malformed")
    for a in value:
        if not isinstance(a, str) or not 0 < len(a) <= _MAX_ADDRESS_LEN:
            raise InviteError(f"invite {what} address {a!r} is malformed")
    return tuple(value)


def _checksum(version: int, body: bytes) -> bytes:
    return hashlib.sha256(bytes([version]) + body).digest()[:_CHECKSUM_LEN]


def encode_invite(invite: Invite) -> str:
    """`meshinv1` + lowercase base32 of (cbor body + 4-byte sha256 checksum), no padding."""
    body = invite.to_cbor()
    raw = body + _checksum(invite.version, body)
    return f"{INVITE_PREFIX}{invite.version}" + base64.b32encode(raw).decode().rstrip("=").lower()


def decode_invite(text: str) -> Invite:
    """Parse an invite; raise InviteError naming the problem on a typo, truncation or corruption.

    Whitespace, dashes and letter case are ignored so a token survives line wrapping.
    """
    cleaned = "".join(ch for ch in text if not ch.isspace() and ch != "-").lower()
    if not cleaned.startswith(INVITE_PREFIX):
        raise InviteError(f"not a meshagent invite: it must start with {INVITE_PREFIX!r}")
    rest = cleaned[len(INVITE_PREFIX) :]
    digits = ""
    while rest and rest[0].isdigit() and len(digits) < 3:
        digits, rest = digits + rest[0], rest[1:]
    if not digits:
        raise InviteError("invite has no version number after 'meshinv'")
    if int(digits) != INVITE_VERSION:
        raise InviteError(
            f"invite version {int(digits)} is not supported (this meshagent reads version "
            f"{INVITE_VERSION}); upgrade meshagent or ask for a new invite"
        )
    padded = rest.upper() + "=" * (-len(rest) % 8)
    try:
        raw = base64.b32decode(padded)
    except (binascii.Error, ValueError) as e:
        raise InviteError(
            "invite contains characters outside base32 (a-z, 2-7) or is truncated; "
            "check it was copied completely"
        ) from e
    if len(raw) <= _CHECKSUM_LEN:
        raise InviteError("invite is too short; check it was copied completely")
    body, checksum = raw[:-_CHECKSUM_LEN], raw[-_CHECKSUM_LEN:]
    if not hmac.compare_digest(checksum, _checksum(INVITE_VERSION, body)):
        raise InviteError("invite checksum does not match: it was mistyped, truncated or altered")
    return Invite.from_cbor(body)
