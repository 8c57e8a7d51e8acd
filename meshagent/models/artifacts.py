"""Stage artifacts in the data dir, keyed by content: slices of models and their manifests."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Collection
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import cbor2
import structlog

from meshagent.errors import ModelError
from meshagent.models.files import file_sha256, write_atomic
from meshagent.models.layout import ModelLayout, inspect_model
from meshagent.models.ranged import PartialModel, Progress, is_partial
from meshagent.models.slicer import tensors_read, write_entry, write_layers
from meshagent.wire.quoted import quoted

log = structlog.get_logger(__name__)

MANIFEST_VERSION = 1
KINDS = ("layers", "entry")


def _count(v: Any) -> bool:
    return type(v) is int and 0 <= v < 1 << 63


def _text(v: Any) -> bool:
    return type(v) is str and len(v) <= 1024


def role_of(start: int, end: int, total: int) -> str:
    if start == 0 and end == total:
        return "whole"
    if start == 0:
        return "first"
    return "last" if end == total else "middle"


@dataclass(frozen=True)
class SliceManifest:
    kind: str  # "layers" or "entry"
    source_sha256: str
    source_name: str
    architecture: str
    start: int
    end: int
    total_layers: int
    role: str
    sha256: str  # of the artifact file
    size_bytes: int  # of the artifact file
    weight_bytes: int  # exact tensor bytes the stage holds
    kv_bytes_per_token_per_layer: int  # f16 K and V
    version: int = MANIFEST_VERSION

    @property
    def key(self) -> str:
        return artifact_key(self.source_sha256, self.kind, self.start, self.end)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SliceManifest:
        if d.get("version") != MANIFEST_VERSION:
            raise ModelError(f"unsupported manifest version {quoted(d.get('version'))}")
        for f in fields(cls):  # a peer sends manifests too: each field of its type, in range
            v = d.get(f.name)  # (one missing: `cls(**d)` names it)
            if f.name in d and not (_text(v) if f.type == "str" else _count(v)):
                raise ModelError(f"malformed manifest: {f.name} is {quoted(v)}")
        try:
            m = cls(**d)
        except TypeError as e:
            raise ModelError(f"malformed manifest: {e}") from e
        if m.kind not in KINDS or not 0 <= m.start <= m.end <= m.total_layers:
            raise ModelError(f"malformed manifest: {m.kind} {m.start}:{m.end}")
        if len(m.sha256) != 64 or len(m.source_sha256) != 64:
            raise ModelError("malformed manifest: bad hash")
        return m

    def to_cbor(self) -> bytes:
        return cbor2.dumps(self.to_dict())

    @classmethod
    def from_cbor(cls, data: bytes) -> SliceManifest:
        try:
            d = cbor2.loads(data)
        except (cbor2.CBORDecodeError, ValueError) as e:
            raise ModelError(f"malformed manifest: {e}") from e
        if not isinstance(d, dict):
            raise ModelError("malformed manifest: not a map")
        return cls.from_dict(d)


def artifact_key(source_sha256: str, kind: str, start: int, end: int) -> str:
    return f"{source_sha256[:32]}-{kind}-{start}-{end}"


def parse_key(key: str) -> tuple[str, str, int, int] | None:
    """(source sha256 prefix, kind, start, end) of an artifact key; None if it is not one."""
    parts = key.split("-")
    if len(parts) != 4 or parts[1] not in KINDS or len(parts[0]) != 32:
        return None
    try:
        start, end = int(parts[2]), int(parts[3])
    except ValueError:
        return None
    return parts[0], parts[1], start, end


class ArtifactStore:
    """`root/blobs/<sha256>.gguf` holds artifacts; `root/manifests/<key>.json` says what they
    are; `root/sources.json` remembers source hashes by (path, size, mtime)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        # One writer at a time: a cut and its index go through fixed temporary names, and a
        # spare cutting ahead of time may race a load that needs the same artifact now.
        self._writing = threading.RLock()
        self.blobs = root / "blobs"
        self.manifests = root / "manifests"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.manifests.mkdir(parents=True, exist_ok=True)

    @property
    def capabilities_path(self) -> Path:
        """Where signed capability records live (`models/capability.py`)."""
        return self.root / "capabilities"

    def blob_path(self, sha256: str) -> Path:
        return self.blobs / f"{sha256}.gguf"

    def source_sha256(self, path: Path) -> str:
        if is_partial(path):  # known from its sidecar: no wait behind a cut downloading
            return PartialModel(path).sha256
        with self._writing:
            return self._source_sha256(path)

    def _source_sha256(self, path: Path) -> str:
        st = path.stat()
        key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        index_path = self.root / "sources.json"
        try:
            index = json.loads(index_path.read_text())
        except (OSError, ValueError):
            index = {}
        if key not in index:
            index[key] = file_sha256(path)
            write_atomic(index_path, json.dumps(index, indent=1).encode())
        return index[key]

    def get(self, key: str) -> SliceManifest | None:
        """The manifest for `key` if its artifact is present."""
        path = self.manifests / f"{key}.json"
        try:
            manifest = SliceManifest.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, ModelError):
            return None
        return manifest if self.blob_path(manifest.sha256).is_file() else None

    def all(self) -> list[SliceManifest]:
        found = (self.get(p.stem) for p in sorted(self.manifests.glob("*.json")))
        return [m for m in found if m is not None]

    def prune(self, source_sha256: str, keep: Collection[str]) -> list[str]:
        """Delete the artifacts of the model `source_sha256` outside `keep`, except the most
        recently used of them while together they take no more bytes than those in `keep`:
        the store holds at most twice a model's working set. Returns the keys deleted."""
        with self._writing:
            mine = [m for m in self.all() if m.source_sha256 == source_sha256]
            room = sum(m.size_bytes for m in mine if m.key in keep)
            others = [m for m in mine if m.key not in keep]
            others.sort(key=lambda m: self._used_at(m.key), reverse=True)
            dropped = []
            for m in others:
                if m.size_bytes <= room:
                    room -= m.size_bytes
                    continue
                (self.manifests / f"{m.key}.json").unlink(missing_ok=True)
                dropped.append(m)
            held = {m.sha256 for m in self.all()}  # a blob another key still names stays
            for m in dropped:
                if m.sha256 not in held:
                    self.blob_path(m.sha256).unlink(missing_ok=True)
            return [m.key for m in dropped]

    def _used_at(self, key: str) -> float:
        try:
            return (self.manifests / f"{key}.json").stat().st_mtime
        except OSError:
            return 0.0

    def drop(self, key: str) -> None:
        """Delete artifact `key` (its bytes proved wrong): the next ensure cuts it again."""
        with self._writing:
            found = self.get(key)
            (self.manifests / f"{key}.json").unlink(missing_ok=True)
            if found is not None:
                self.blob_path(found.sha256).unlink(missing_ok=True)

    def install(self, manifest: SliceManifest, file: Path) -> Path:
        """Move a verified artifact file into the store under its manifest."""
        with self._writing:
            return self._install(manifest, file)

    def _install(self, manifest: SliceManifest, file: Path) -> Path:
        actual = file_sha256(file)
        if actual != manifest.sha256:
            file.unlink(missing_ok=True)
            raise ModelError(f"artifact {manifest.key} hash mismatch: {actual}")
        dst = self.blob_path(manifest.sha256)
        os.replace(file, dst)
        write_atomic(
            self.manifests / f"{manifest.key}.json",
            json.dumps(manifest.to_dict(), indent=1).encode(),
        )
        return dst

    def ensure_layers(
        self,
        model: Path,
        start: int,
        end: int,
        layout: ModelLayout | None = None,
        *,
        progress: Progress | None = None,
    ) -> tuple[Path, SliceManifest]:
        """The layers artifact for [start, end) of `model`, cut now if not cached. From a
        partial copy, `progress(done, total)` follows the bytes it downloads for the cut."""
        with self._writing:
            return self._cut(model, "layers", start, end, layout, progress)

    def ensure_entry(
        self, model: Path, layout: ModelLayout | None = None, *, progress: Progress | None = None
    ) -> tuple[Path, SliceManifest]:
        with self._writing:
            return self._cut(model, "entry", 0, 0, layout, progress)

    def _cut(
        self,
        model: Path,
        kind: str,
        start: int,
        end: int,
        layout: ModelLayout | None,
        progress: Progress | None = None,
    ) -> tuple[Path, SliceManifest]:
        source = self.source_sha256(model)
        key = artifact_key(source, kind, start, end)
        found = self.get(key)
        if found is not None:
            with contextlib.suppress(OSError):  # used now: the last a prune deletes
                os.utime(self.manifests / f"{key}.json")
            return self.blob_path(found.sha256), found
        layout = layout or inspect_model(model)
        if is_partial(model):  # download the bytes the cut reads, only those
            part = PartialModel(model)
            if kind == "entry" or end == layout.n_layers:
                part.fill_gaps(progress)  # these carry the tokenizer
            part.ensure_tensors(tensors_read(layout, kind, start, end), progress)
        tmp = self.blobs / f"{key}.tmp"
        provenance: dict[str, str | int] = {"source_sha256": source, "start": start, "end": end}
        log.info("artifact.cutting", model=model.name, kind=kind, layers=(start, end))
        if kind == "entry":
            write_entry(layout, tmp, provenance=provenance)
            weights = layout.embedding_bytes
            role = "entry"
        else:
            write_layers(layout, start, end, tmp, provenance=provenance)
            weights = layout.weight_bytes(start, end) - (
                layout.embedding_bytes if start == 0 else 0
            )
            role = role_of(start, end, layout.n_layers)
        manifest = SliceManifest(
            kind=kind,
            source_sha256=source,
            source_name=model.name,
            architecture=layout.architecture,
            start=start,
            end=end,
            total_layers=layout.n_layers,
            role=role,
            sha256=file_sha256(tmp),
            size_bytes=tmp.stat().st_size,
            weight_bytes=weights,
            kv_bytes_per_token_per_layer=layout.kv_bytes_per_token_per_layer,
        )
        return self._install(manifest, tmp), manifest
