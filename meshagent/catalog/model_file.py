"""What an agent reads of a model it adds to the catalogue: the file a name or path resolves
to here (downloading a hub model), its sha256, its size and its layout. Blocking: run it off
the event loop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshagent.catalog.entry import CatalogEntry
from meshagent.errors import ModelError
from meshagent.models.artifacts import ArtifactStore
from meshagent.models.default import resolve_model
from meshagent.models.layout import ModelLayout, inspect_model
from meshagent.models.names import HubName, parse_model_name

Resolve = Callable[[str], Path]  # `resolve_model`'s shape: a model argument to a local file


@dataclass(frozen=True)
class ModelFile:
    name: str  # the id the API serves it as: the file's name without `.gguf`
    source: str  # what other agents resolve: the hub name, or this file's absolute path
    path: Path
    sha256: str
    size: int
    layout: ModelLayout

    def entry(self, *, version: int, time: int) -> CatalogEntry:
        """The catalogue entry that adds this model."""
        return CatalogEntry.add(
            self.name, self.source, self.sha256, self.size, self.layout, version=version, time=time
        )


def source_of(spec: str) -> str:
    """What an entry records as the model's source: a hub name as written canonically, a
    path made absolute, the empty string (the embedded default) as it is. ModelError for
    what is neither a path nor a name."""
    if not spec:
        return ""
    name = parse_model_name(spec)
    if isinstance(name, HubName):
        return str(name)
    return str(name.expanduser().absolute())


def read_model_file(spec: str, store: ArtifactStore, resolve: Resolve = resolve_model) -> ModelFile:
    """Resolve `spec` (a path, a hub name: downloaded if not here yet, or "" for the embedded
    default) and read what an entry says of it. ModelError saying what is wrong otherwise."""
    source = source_of(spec)
    try:
        path = resolve(source)
    except OSError as e:  # a disk that fails or fills while the hub's bytes come
        raise ModelError(f"{spec} could not be had here: {e}") from e
    layout = inspect_model(path)  # ModelError for a file that is not a model GGUF
    try:
        sha256 = store.source_sha256(path)  # kept in the store's index: hashed once
    except OSError as e:
        raise ModelError(f"{path} cannot be read: {e}") from e
    return ModelFile(
        path.name.removesuffix(".gguf"), source, path, sha256, layout.file_bytes, layout
    )
