"""Key files (the identity, the mesh secret) and config.toml: private from their first byte,
flushed to disk before they are renamed into place, and the directory flushed after."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from meshagent.config import DataDir
from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret
from meshagent.identity.mesh_file import load_mesh, save_mesh


@pytest.fixture
def open_umask():
    """A umask that lets every user read new files, as some systems set it."""
    old = os.umask(0o002)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def saving_identity(path: Path) -> None:
    NodeIdentity.generate().save(path)


def saving_mesh(path: Path) -> None:
    save_mesh(path, MeshSecret.generate())


SAVERS = [saving_identity, saving_mesh]


@pytest.mark.parametrize("save", SAVERS)
def test_a_key_file_is_flushed_before_its_rename_and_the_directory_after(
    save, tmp_path, monkeypatch
):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        events.append(("fsync", kind))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("rename", Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "keys" / "secret.key"
    save(path)
    rename = events.index(("rename", "secret.key"))
    assert ("fsync", "file") in events[:rename], events
    assert ("fsync", "dir") in events[rename:], events
    assert path.exists() and [p.name for p in path.parent.iterdir()] == ["secret.key"]


@pytest.mark.parametrize("save", SAVERS)
def test_a_key_file_is_private_whatever_the_umask(save, tmp_path, open_umask):
    path = tmp_path / "secret.key"
    save(path)
    assert mode(path) == 0o600


def test_replacing_a_mesh_file_others_could_read_makes_it_private(tmp_path):
    path = tmp_path / "mesh.key"
    save_mesh(path, MeshSecret.generate())
    path.chmod(0o644)
    joined = MeshSecret.generate()
    save_mesh(path, joined)  # `up --join` replaces the stored mesh
    assert mode(path) == 0o600 and load_mesh(path) == joined


def test_config_toml_is_written_private_whatever_the_umask(tmp_path, open_umask):
    dd = DataDir(tmp_path / "data")
    dd.ensure()
    assert mode(dd.config_path) == 0o600
    assert dd.config_path.read_text().startswith("# meshagent")
