"""The node's ed25519 identity, created once and kept in the data dir (mode 0600)."""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from pathlib import Path

from nacl.signing import SigningKey, VerifyKey

from meshagent.errors import ConfigError
from meshagent.identity.private_file import write_private

KEY_FILE_HEADER = b"meshagent-ed25519-v1\n"


def peer_id_for(public_key: bytes) -> str:
    """A short, printable, self-certifying id: base32 of sha256(public key), 26 chars."""
    digest = hashlib.sha256(b"meshagent-peer-id" + public_key).digest()
    return base64.b32encode(digest[:16]).decode().rstrip("=").lower()


@dataclass(frozen=True)
class NodeIdentity:
    signing_key: SigningKey

    @property
    def public_key(self) -> bytes:
        return bytes(self.signing_key.verify_key)

    @property
    def verify_key(self) -> VerifyKey:
        return self.signing_key.verify_key

    @property
    def peer_id(self) -> str:
        return peer_id_for(self.public_key)

    def sign(self, message: bytes) -> bytes:
        return self.signing_key.sign(message).signature

    @classmethod
    def generate(cls) -> NodeIdentity:
        return cls(SigningKey.generate())

    def save(self, path: Path) -> None:
        """Write the seed to `path` with mode 0600, never exposing it to other users, and
        flushed to disk before it replaces the old file (`private_file.write_private`)."""
        write_private(path, KEY_FILE_HEADER + base64.b64encode(bytes(self.signing_key)) + b"\n")

    @classmethod
    def load(cls, path: Path) -> NodeIdentity:
        data = path.read_bytes()
        if not data.startswith(KEY_FILE_HEADER):
            raise ConfigError(f"{path} is not a meshagent identity file")
        try:
            seed = base64.b64decode(data[len(KEY_FILE_HEADER) :].strip(), validate=True)
        except ValueError as e:
            raise ConfigError(f"{path} is corrupt: {e}") from e
        if len(seed) != 32:
            raise ConfigError(f"{path} is corrupt: expected a 32-byte seed")
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise ConfigError(
                f"{path} is readable by other users (mode {mode:o}); run `chmod 600 {path}`"
            )
        return cls(SigningKey(seed))

    @classmethod
    def load_or_create(cls, path: Path) -> tuple[NodeIdentity, bool]:
        """Load the identity at `path`, creating it on first use; says whether it was created."""
        if path.exists():
            return cls.load(path), False
        ident = cls.generate()
        ident.save(path)
        return ident, True
