"""Getting a stage artifact of a model this agent holds only in part (`models/ranged.py`):
from a peer that holds it first, from the hub as the fallback.

A peer's copy comes over the overlay with per-chunk hashes (`models/transfer.py`), checked
against the sha256 and size that peer publishes in gossip (a copy cut on request: against
the size of the model file), and a peer whose messages break the protocol ends only that
fetch. A copy cut from ranges fetched off the hub
is checked against the sha256 any peer publishes for the same artifact: a mismatch drops the
ranges it was cut from and fetches them again, once. With no published hash to compare, the
artifact is kept and marked unverified (`meshagent status` says so): its bytes are only known
to have the lengths and places its header gives.

An agent that holds the whole file cuts its artifacts locally and needs none of this.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog
import trio

from meshagent.errors import MeshError, ModelError
from meshagent.gossip.peer_record import ArtifactHeld, ModelHeld
from meshagent.models import transfer
from meshagent.models.artifacts import ArtifactStore, SliceManifest, artifact_key, parse_key
from meshagent.models.layout import ModelLayout
from meshagent.models.ranged import (
    PartialModel,
    Progress,
    Ranges,
    coalesce,
    is_partial,
    logging_progress,
)
from meshagent.models.slicer import tensors_read
from meshagent.placement.planner import Plan

log = structlog.get_logger(__name__)

OpenStream = Callable[[str, str], Awaitable[Any]]  # (peer_id, label) -> stream
# What a slice adds to the bytes it copies from its model file: its provenance keys, padding.
_SLICE_SLACK = 1 << 20


def published(views: Mapping[str, Any], key: str, me: str) -> dict[str, ArtifactHeld]:
    """Peer -> what it publishes of artifact `key` (its sha256 and size), for every other
    peer holding it."""
    out = {}
    for peer_id, view in views.items():
        if peer_id == me:
            continue
        for held in view.record.artifacts:
            if held.key == key:
                out[peer_id] = held
    return out


def file_holders(views: Mapping[str, Any], sha256: str, me: str) -> list[str]:
    """The other peers whose gossip record lists the whole model file `sha256` (they cut any
    artifact of it for a peer that asks: `transfer.ArtifactServer`)."""
    return [
        peer_id
        for peer_id, view in views.items()
        if peer_id != me and any(m.sha256 == sha256 for m in view.record.models)
    ]


def spare_cuts(plan: Plan, peer_id: str) -> list[tuple[str, int, int]]:
    """The artifacts a spare (`peer_id` outside `plan`) would need to take over any stage of
    the split `plan`: each stage's layers, and the entry's token embedding for the first.
    Nothing for a whole-model plan or a peer of the plan."""
    if not plan.split or peer_id in plan.peers:
        return []
    cuts = list(dict.fromkeys(("layers", s.start, s.end) for c in plan.pipelines for s in c))
    return [("entry", 0, 0), *cuts]


def cuts_here(plan: Plan, peer_id: str) -> list[tuple[str, int, int]]:
    """The artifacts this agent's part of the split `plan` loads (its stage's layers, and the
    entry's token embedding for the first), or those a spare prepares (`spare_cuts`)."""
    if not plan.split:
        return []
    mine = [("layers", s.start, s.end) for c in plan.pipelines for s in c if s.peer_id == peer_id]
    if any(start == 0 for _, start, _ in mine):
        mine.insert(0, ("entry", 0, 0))
    return mine or spare_cuts(plan, peer_id)


def needed_by(plan: Plan, key: str) -> bool:
    """Whether the split `plan` needs artifact `key`: the entry's, or a stage's layers."""
    parsed = parse_key(key)
    if parsed is None or not plan.split:
        return False
    _, kind, start, end = parsed
    return kind == "entry" or any(
        (s.start, s.end) == (start, end) for c in plan.pipelines for s in c
    )


def cut_artifact(
    store: ArtifactStore,
    model_path: Path,
    layout: ModelLayout,
    kind: str,
    start: int,
    end: int,
    progress: Progress | None = None,
) -> SliceManifest:
    """The store's artifact (`kind`, `start`, `end`) of the model, cut now if it lacks it
    (blocking; a partial copy downloads the ranges the cut reads, told to `progress`)."""
    if kind == "entry":
        return store.ensure_entry(model_path, layout, progress=progress)[1]
    return store.ensure_layers(model_path, start, end, layout, progress=progress)[1]


@dataclass
class Fetch:
    """An artifact being downloaded: from where, and how far it is (`meshagent status`)."""

    key: str
    source: str  # "peer <id>" or "hub"
    done_bytes: int = 0
    total_bytes: int = 0  # 0 until the first bytes arrive

    def progress(self, log_event: str, **what: str) -> Progress:
        """A `Progress` that keeps this up to date and logs a line per tenth."""
        say = logging_progress(log_event, **what)

        def report(done: int, total: int) -> None:
            self.done_bytes, self.total_bytes = done, total
            say(done, total)

        return report


class ArtifactSource:
    """Obtains the artifacts of the model at `model_path` for `store`."""

    def __init__(
        self,
        *,
        peer_id: str,
        model_path: Path,
        layout: ModelLayout,
        store: ArtifactStore,
        views: Callable[[], Mapping[str, Any]],
        open_stream: OpenStream,
    ) -> None:
        self.peer_id = peer_id
        self.model_path = model_path
        self.layout = layout
        self.store = store
        self.views = views  # gossip's snapshot: peer -> view with .record.artifacts
        self.open_stream = open_stream
        self._fetching: dict[str, Fetch] = {}  # artifact key -> its download under way

    def downloads(self) -> list[dict[str, Any]]:
        """The artifacts being downloaded now, for the status document."""
        return [asdict(f) for f in list(self._fetching.values())]

    @property
    def partial(self) -> PartialModel | None:
        """The partial copy this agent's model is, unless it is whole here."""
        if not is_partial(self.model_path):
            return None
        part = PartialModel(self.model_path)
        return None if part.complete else part

    def cut_for_peer(self, key: str) -> SliceManifest | None:
        """`transfer.Cutter`: artifact `key` of this model cut from the whole file for a peer
        that asks, or None where this agent holds only part of the file, or another file
        (blocking)."""
        parsed = parse_key(key)
        if parsed is None or self.partial is not None:
            return None
        prefix, kind, start, end = parsed
        if not self.store.source_sha256(self.model_path).startswith(prefix):
            return None
        return self._cut(kind, start, end)

    async def complete(self, info: Any, gossip: Any) -> None:
        """Before the whole model loads from a partial copy: fetch every range not here,
        check the file against the hub's sha256, then tell the mesh this agent holds the
        file (gossip `models`), so peers may fetch its artifacts from it."""
        part = self.partial
        if part is None:
            return
        await trio.to_thread.run_sync(part.ensure_whole)
        held = ModelHeld(info.id, part.sha256, info.architecture, info.n_layers, info.size_bytes)
        me = gossip.snapshot().get(gossip.peer_id)  # the other models held here stay said
        others = tuple(m for m in me.record.models if m.sha256 != held.sha256) if me else ()
        gossip.update_local(models=(*others, held))

    async def obtain(self, kind: str, start: int, end: int, *, hub: bool = True) -> None:
        """Make sure the store holds the artifact (`kind`, `start`, `end`); an agent with the
        whole file leaves it to the store, which cuts it when asked. `hub=False`: only from
        a peer (a spare preparing ahead of need downloads nothing from the hub)."""
        part = self.partial
        if part is None:
            return
        key = artifact_key(part.sha256, kind, start, end)
        if self.store.get(key) is not None:
            return
        views = self.views()
        # Peers that hold the artifact (checked against the hash and size each publishes),
        # then peers that hold the whole file and cut it on request; the hub last. A slice
        # copies part of the file (`_SLICE_SLACK`: what it adds), so none is larger.
        sources = list(published(views, key, self.peer_id).items())
        sources += [(p, None) for p in file_holders(views, part.sha256, self.peer_id)]
        for peer_id, held in sources:
            fetch = self._fetching[key] = Fetch(key, f"peer {peer_id}")
            try:
                _, manifest = await transfer.fetch_artifact(
                    lambda p=peer_id: self.open_stream(p, transfer.LABEL),
                    key,
                    self.store,
                    expected_sha256=held.sha256 if held is not None else None,
                    expected_size=held.size_bytes if held is not None else None,
                    max_size=part.remote.size + _SLICE_SLACK,
                    progress=fetch.progress("artifact.progress", key=key, peer=peer_id),
                    max_attempts=2,
                )
            except (MeshError, OSError) as e:
                log.warning("artifact.peer_fetch_failed", key=key, peer=peer_id, error=str(e))
                continue
            finally:
                self._fetching.pop(key, None)
            await trio.to_thread.run_sync(part.note_artifact, key, "from peer", manifest.size_bytes)
            log.info("artifact.from_peer", key=key, peer=peer_id, bytes=manifest.size_bytes)
            return
        if hub:
            await self._from_hub(part, kind, start, end, key)

    async def _from_hub(
        self, part: PartialModel, kind: str, start: int, end: int, key: str
    ) -> None:
        """Cut the artifact from ranges fetched off the hub, checked against the hash peers
        publish for it."""
        for attempt in (1, 2):
            fetch = self._fetching[key] = Fetch(key, "hub")
            progress = fetch.progress("partial.progress", file=part.remote.filename, key=key)
            try:
                manifest = await trio.to_thread.run_sync(self._cut, kind, start, end, progress)
            finally:
                self._fetching.pop(key, None)
            agreed = {h.sha256 for h in published(self.views(), key, self.peer_id).values()}
            if not agreed or manifest.sha256 in agreed:
                verdict = "verified" if agreed else "unverified"
                await trio.to_thread.run_sync(part.note_artifact, key, verdict)
                # Its bytes live in the artifact now: the partial copy gives their disk back.
                ranges = await trio.to_thread.run_sync(self._ranges, part, kind, start, end)
                freed = await trio.to_thread.run_sync(part.release, ranges)
                log.info("artifact.from_hub", key=key, checked=verdict, released=freed)
                return
            log.warning("artifact.hash_mismatch", key=key, got=manifest.sha256, attempt=attempt)
            await trio.to_thread.run_sync(self._reject, part, kind, start, end, key)
        raise ModelError(
            f"artifact {key} cut from the hub's bytes twice does not match the sha256 peers "
            "publish for it: the hub's file or a peer's copy is not what it claims"
        )

    async def prepare_spare(
        self, plan: Plan, failed: set[tuple[str, int, int]], still: Callable[[], bool]
    ) -> None:
        """As a spare of the split `plan` (outside it, offering memory): get its stages'
        artifacts ahead of need, while `still()`, so that a repair giving this agent a lost
        stage only loads it. From peers only for a partial copy (nothing from the hub ahead
        of need); cut from the file otherwise. What fails is added to `failed`, not retried."""
        for kind, start, end in spare_cuts(plan, self.peer_id):
            if (kind, start, end) in failed or not still():
                continue
            try:
                if self.partial is not None:
                    await self.obtain(kind, start, end, hub=False)
                else:
                    await trio.to_thread.run_sync(self._cut, kind, start, end)
            except (MeshError, OSError) as e:
                failed.add((kind, start, end))
                log.warning("mesh_model.spare_cut_failed", layers=(start, end), error=str(e))

    def prune(self, plan: Plan) -> list[str]:
        """Delete this model's artifacts that the split `plan` does not need here, beyond as
        many bytes again as those it needs (the most recently used first): old plans' slices
        and cuts made for peers do not fill the disk (blocking). Returns the keys deleted.
        Nothing while the model is served whole: the artifacts here are then the user's (cut
        with `meshagent models slice`, to share) or a split's to come."""
        if not plan.split:
            return []
        try:
            sha = self.store.source_sha256(self.model_path)
            keep = {artifact_key(sha, *cut) for cut in cuts_here(plan, self.peer_id)}
            dropped = self.store.prune(sha, keep)
        except (OSError, ModelError) as e:  # a disk that refuses: the artifacts stay
            log.warning("artifact.prune_failed", error=str(e))
            return []
        if dropped:
            log.info("artifact.pruned", keys=dropped, kept=len(keep))
        return dropped

    def _reject(self, part: PartialModel, kind: str, start: int, end: int, key: str) -> None:
        """Drop the artifact and forget the ranges it was cut from: fetched again next."""
        self.store.drop(key)
        part.forget(self._ranges(part, kind, start, end))

    def _ranges(self, part: PartialModel, kind: str, start: int, end: int) -> Ranges:
        """The byte ranges an artifact is cut from, tensors a few bytes apart joined (so a
        release frees whole blocks between them). Reads the header: off the event loop."""
        return coalesce(part.tensor_ranges(tensors_read(self.layout, kind, start, end)))

    def _cut(
        self, kind: str, start: int, end: int, progress: Progress | None = None
    ) -> SliceManifest:
        return cut_artifact(self.store, self.model_path, self.layout, kind, start, end, progress)
