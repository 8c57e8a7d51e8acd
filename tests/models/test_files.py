import errno
import hashlib
from pathlib import Path

import pytest

from meshagent.models.files import file_sha256, write_atomic


def test_file_sha256_is_the_sha256_of_the_bytes_read_in_chunks(tmp_path):
    data = bytes(range(256)) * 1000
    path = tmp_path / "f"
    path.write_bytes(data)
    assert file_sha256(path, chunk=1000) == hashlib.sha256(data).hexdigest()


def test_write_atomic_replaces_a_file_whole(tmp_path):
    path = tmp_path / "index.json"
    path.write_bytes(b"old")
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["index.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    path = tmp_path / "index.json"
    path.write_bytes(b"old")
    real = Path.write_bytes

    def full_disk(self, data):
        real(self, data[:1])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full_disk)
    with pytest.raises(OSError):
        write_atomic(path, b"new")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["index.json"]
