"""The mesh secret kept in the data dir (mode 0600), created or replaced by an invite."""

from __future__ import annotations

import base64
from pathlib import Path

from meshagent.errors import ConfigError
from meshagent.identity.mesh import SECRET_LEN, MeshSecret
from meshagent.identity.private_file import write_private

HEADER = b"meshagent-mesh-v1\n"


def save_mesh(path: Path, secret: MeshSecret) -> None:
    """Store the secret with mode 0600, flushed to disk before it replaces the old file."""
    write_private(path, HEADER + base64.b64encode(secret.value) + b"\n")


def load_mesh(path: Path) -> MeshSecret:
    data = path.read_bytes()
    if not data.startswith(HEADER):
        raise ConfigError(f"{path} is not a meshagent mesh file")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ConfigError(
            f"{path} is readable by other users (mode {mode:o}); run `chmod 600 {path}`"
        )
    try:
        value = base64.b64decode(data[len(HEADER) :].strip(), validate=True)
    except ValueError as e:
        raise ConfigError(f"{path} is corrupt: {e}") from e
    if len(value) != SECRET_LEN:
        raise ConfigError(f"{path} is corrupt: expected a {SECRET_LEN}-byte secret")
    return MeshSecret(value)


def load_or_create_mesh(path: Path, join: MeshSecret | None = None) -> tuple[MeshSecret, str]:
    """The mesh this agent belongs to: the one joined now, the stored one, or a new one.
    Returns (secret, how: "joined" | "stored" | "created")."""
    if join is not None:
        save_mesh(path, join)
        return join, "joined"
    if path.exists():
        return load_mesh(path), "stored"
    secret = MeshSecret.generate()
    save_mesh(path, secret)
    return secret, "created"
