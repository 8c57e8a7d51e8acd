"""The catalogue kept in the data dir (`DataDir.catalog_path`), so that it survives a restart
and the agent gossips it on: CBOR `{0: 1, 1: [signed entry (bstr)...]}`, replaced whole or
not at all. Every entry is verified again when read: a file changed on disk is not trusted."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import cbor2

from meshagent.catalog.book import MAX_KEPT
from meshagent.catalog.entry import MAX_ENTRY_BYTES, SignedEntry
from meshagent.errors import CatalogError
from meshagent.models.files import write_atomic

FILE_VERSION = 1
MAX_FILE_BYTES = MAX_KEPT * (MAX_ENTRY_BYTES + 8) + 64


def save_entries(path: Path, entries: Iterable[SignedEntry]) -> None:
    """Replace the file with `entries`."""
    blobs = [s.to_bytes() for s in entries]
    write_atomic(path, cbor2.dumps({0: FILE_VERSION, 1: blobs}))


def load_entries(path: Path) -> tuple[list[SignedEntry], list[str]]:
    """The entries the file holds (none if there is no file), and why any was refused: an
    entry that fails to verify is left out, a file that cannot be read gives none."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], []
    except OSError as e:
        return [], [f"{path} cannot be read ({e})"]
    if len(data) > MAX_FILE_BYTES:
        return [], [f"{path} is {len(data)} bytes, more than a catalogue holds"]
    try:
        d = cbor2.loads(data)
    except Exception as e:  # cbor2 raises several unrelated types on garbage
        return [], [f"{path} is not valid CBOR ({e})"]
    if (
        not isinstance(d, dict)
        or type(d.get(0)) is not int
        or d[0] != FILE_VERSION
        or not isinstance(d.get(1), list)
    ):
        return [], [f"{path} is not a catalogue file of version {FILE_VERSION}"]
    entries, refused = [], []
    for blob in d[1][:MAX_KEPT]:
        try:
            entries.append(SignedEntry.from_bytes(blob))
        except CatalogError as e:
            refused.append(f"{path}: {e}")
    return entries, refused
