"""The mesh's catalogue of models as one agent takes part in it.

`Catalog` holds this agent's book (`book.py`), kept in the data dir (`book_file.py`). Its user
adds a model by name or path (`add`: resolved and read here, then signed with the agent's
identity) or removes one (`remove`: a signed tombstone). What peers gossip (`PeerRecord.catalog`)
is verified once per blob and merged in (`heard`); what this agent gossips is its book's
`published` blobs. `run` does both whenever gossip changes, and spreads this agent's catalogue
at once when it changed, so that an add reaches every agent within a few round trips.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import structlog
import trio

from meshagent.catalog.book import MAX_LIVE, CatalogBook
from meshagent.catalog.book_file import load_entries, save_entries
from meshagent.catalog.entry import CatalogEntry, SignedEntry
from meshagent.catalog.model_file import ModelFile, Resolve, read_model_file
from meshagent.errors import CatalogError, NotCatalogued
from meshagent.gossip.errors import GossipError
from meshagent.identity.keys import NodeIdentity
from meshagent.models.artifacts import ArtifactStore
from meshagent.models.default import resolve_model
from meshagent.waiting import Generation, first

log = structlog.get_logger(__name__)

EXPIRE_EVERY = 3600.0  # seconds between looks for tombstones to drop, when nothing changes
_MAX_CHECKED = 1024  # gossiped blobs whose verdict is kept


class CatalogGossip(Protocol):
    """What the catalogue needs of gossip (meshagent.gossip.service.GossipService fits)."""

    def snapshot(self) -> Mapping[str, Any]: ...

    def update_local(self, **fields: Any) -> None: ...

    def spread_now(self) -> None: ...

    async def wait_changed(self, after: int) -> int: ...

    @property
    def generation(self) -> int: ...


class Catalog:
    def __init__(
        self,
        identity: NodeIdentity,
        path: Path,
        store: ArtifactStore,
        *,
        resolve: Resolve = resolve_model,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`path` is the file the catalogue is kept in (read now); `store` hashes the files
        added; `resolve` turns a name or path into a local file (may download); `clock` is
        the wall clock entries are signed with."""
        self.identity = identity
        self.path = path
        self.store = store
        self._resolve = resolve
        self._clock = clock
        entries, refused = load_entries(path)
        for why in refused:
            log.warning("catalog.refused", source="file", error=why)
        self.book = CatalogBook(entries, now=clock())
        self._published = self._publishable()
        self._checked: dict[bytes, SignedEntry | None] = {}  # gossiped bytes, verified once
        self._heard: dict[str, tuple[bytes, ...]] = {}  # each peer's blobs last merged
        self._changes = Generation()

    # ----- what the catalogue holds -----

    def entries(self) -> dict[str, CatalogEntry]:
        """The catalogue: each model added and not removed since, by name (in name order)."""
        return {name: s.entry for name, s in self.book.live().items()}

    def signed_entries(self) -> list[SignedEntry]:
        """The same, signed: who added each model, and the bytes gossiped."""
        return list(self.book.live().values())

    def entry(self, name: str) -> CatalogEntry | None:
        """The catalogued model of that name (compared without case), if any."""
        held = self.book.winner(name)
        return held.entry if held is not None and held.entry.is_add else None

    def published(self) -> tuple[bytes, ...]:
        """What this agent gossips (`PeerRecord.catalog`)."""
        return self._published

    @property
    def generation(self) -> int:
        """Increases whenever the book changes (an add, a removal, a tombstone dropped)."""
        return self._changes.value

    async def wait_changed(self, after: int) -> int:
        """Wait until the generation passes `after`; returns the new generation."""
        return await self._changes.wait_past(after)

    # ----- this agent's user changes it -----

    async def add(
        self, spec: str, progress: Callable[[int, int], None] | None = None
    ) -> SignedEntry:
        """Add the model `spec` names (a path here, a hub name, "" the embedded default):
        resolved (a hub model downloaded) and read in a worker thread, then signed.
        `progress(done, total)` hears of a download, on that thread. ModelError when it
        cannot be had or read; CatalogError when it cannot be added."""
        resolve = self._resolve
        if progress is not None:
            resolve = partial(self._resolve, progress=progress)  # type: ignore[call-arg]
        model = await trio.to_thread.run_sync(read_model_file, spec, self.store, resolve)
        return self.add_model(model)

    def add_model(self, model: ModelFile) -> SignedEntry:
        """Add a model already read here. The same file under the same name and source is
        catalogued once: its entry stands and is returned."""
        held = self.book.winner(model.name)
        if held is not None and held.entry.is_add:
            e = held.entry
            if e.sha256 == model.sha256 and e.source == model.source and e.name == model.name:
                return held
        elif len(self.book.live()) >= MAX_LIVE:
            raise CatalogError(
                f"the mesh's catalogue holds {MAX_LIVE} models, the most it may: remove one "
                f"(`meshagent models remove NAME`) before adding {model.name}"
            )
        entry = model.entry(version=self.book.next_version(model.name), time=self._now())
        signed = entry.sign(self.identity)
        self._take([signed])
        log.info(
            "catalog.added",
            model=entry.name,
            source=entry.source,
            sha256=entry.sha256,
            version=entry.version,
        )
        return signed

    def remove(self, name: str) -> SignedEntry:
        """Remove the model `name` from the catalogue: a tombstone signed here.
        NotCatalogued when no model of that name is catalogued."""
        held = self.book.winner(name)
        if held is None or not held.entry.is_add:
            raise NotCatalogued(f"{name} is not in the mesh's catalogue")
        entry = CatalogEntry.remove(
            held.entry.name, version=self.book.next_version(name), time=self._now()
        )
        signed = entry.sign(self.identity)
        self._take([signed])
        log.info("catalog.removed", model=entry.name, version=entry.version)
        return signed

    # ----- gossip -----

    def heard(self, views: Mapping[str, Any]) -> bool:
        """Merge what the peers in `views` (gossip's snapshot: peer id -> view with a
        `record`) gossip; says whether the catalogue changed. A blob that fails to verify
        is logged and skipped."""
        fresh: list[SignedEntry] = []
        for peer, view in views.items():
            if peer == self.identity.peer_id:
                continue
            blobs = tuple(getattr(getattr(view, "record", None), "catalog", ()))
            if self._heard.get(peer) == blobs:
                continue  # merged already: merging is idempotent
            self._heard[peer] = blobs
            fresh += (s for s in (self._verified(peer, b) for b in blobs) if s is not None)
        for gone in self._heard.keys() - views.keys():
            del self._heard[gone]
        return self._take(fresh, heard=True)

    def expire(self) -> bool:
        """Drop tombstones past their time; says whether any was."""
        return self._take(())

    async def run(
        self,
        gossip: CatalogGossip,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Merge what peers gossip whenever gossip changes, and publish this agent's
        catalogue (spread at once) whenever it changes, until cancelled."""
        published: tuple[bytes, ...] = ()
        task_status.started()
        while True:
            seen, mine = gossip.generation, self._changes.value
            self.heard(gossip.snapshot())
            self.expire()
            if self._published != published:
                try:
                    gossip.update_local(catalog=self._published)
                except GossipError as e:
                    log.warning("catalog.publish_failed", error=str(e))
                else:
                    gossip.spread_now()
                    published = self._published
            with trio.move_on_after(EXPIRE_EVERY):
                await first(partial(gossip.wait_changed, seen), partial(self.wait_changed, mine))

    # ----- the book, kept -----

    def _take(self, entries: Iterable[SignedEntry], *, heard: bool = False) -> bool:
        if not self.book.merge(entries, now=self._clock()):
            return False
        if not heard:
            # What peers gossip is merged again: an entry the bound left out may fit now.
            self._heard.clear()
        self._published = self._publishable()
        self._changes.bump()
        try:
            save_entries(self.path, self.book.entries())
        except OSError as e:  # the catalogue goes on in memory and in gossip
            log.warning("catalog.save_failed", path=str(self.path), error=str(e))
        return True

    def _publishable(self) -> tuple[bytes, ...]:
        return tuple(s.to_bytes() for s in self.book.gossiped())

    def _verified(self, peer: str, blob: bytes) -> SignedEntry | None:
        if blob not in self._checked:
            if len(self._checked) >= _MAX_CHECKED:  # entries replaced over a long run
                self._checked.clear()
            try:
                self._checked[blob] = SignedEntry.from_bytes(blob)
            except CatalogError as e:
                log.warning("catalog.refused", source=peer, error=str(e))
                self._checked[blob] = None
        return self._checked[blob]

    def _now(self) -> int:
        return int(self._clock())
