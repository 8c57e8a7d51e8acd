"""Files on disk as the artifact store and partial model copies keep them: a file's sha256, and
replacing a file whole or not at all."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def file_sha256(path: Path, *, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` whole or not at all (a temporary file, then a rename); a
    write that fails (a full disk) leaves the old file and no temporary one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
