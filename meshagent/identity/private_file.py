"""Files only this user may read (keys, the mesh secret, a config that may hold API keys),
written whole or not at all.

The bytes go to a temporary file created with mode 0600 beside the target, are flushed to
disk (fsync), and the file is renamed over the target; the directory is flushed too, so that
after a crash or power cut the target holds either its old bytes or the new ones, never a
truncated key, and at no moment can another user read it."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

PRIVATE_MODE = 0o600


def write_private(path: Path, data: bytes) -> None:
    """Replace `path` with `data`, mode 0600 (also where the old file was wider)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, PRIVATE_MODE)
    try:
        os.fchmod(fd, PRIVATE_MODE)  # a stale temp file of another mode is reused as 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Flush a directory's entries (a rename into it) to disk, where the OS allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename stands anyway
    finally:
        os.close(fd)


def readable_by_others(path: Path) -> int | None:
    """The file's mode when its group or other users may read or write it, else None."""
    mode = stat.S_IMODE(path.stat().st_mode)
    return mode if mode & 0o077 else None
