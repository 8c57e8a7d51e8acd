"""Loading the draft model an agent was given (`meshagent up --draft-model`) beside a model it
serves: whole, or as a split's entry (the draft model runs where requests enter).

With `auto`, the draft model is chosen for each target: the largest model in the mesh's
catalogue that shares the target's vocabulary (`vocab_sha256`, the hash of its tokens' list)
and is at most `1/AUTO_RATIO` of its size, where this agent has or can get its file and it
fits in the memory left; else the embedded SmolLM2-135M, which drafts across tokenizers,
where the target is at least `AUTO_RATIO` times its size; else none.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import structlog
import trio

from meshagent import wording
from meshagent.catalog.entry import CatalogEntry
from meshagent.engine.base import TokenModel
from meshagent.engine.llama import LlamaEngine
from meshagent.errors import MeshError
from meshagent.models.default import draft_model_path, local_file
from meshagent.serving.draft_model import DraftModel, same_vocabulary
from meshagent.serving.model_files import ModelFiles
from meshagent.serving.settings import ServingSettings

log = structlog.get_logger(__name__)

# `--draft-model auto` drafts for targets at least this many times the draft model's size: a
# forward pass of a model a sixth of the target's size costs about a sixth of the target's
# step, and a window of its drafts then pays where several are right.
AUTO_RATIO = 6

# The file of a catalogued model that can draft for a target (`catalogued_draft`); None:
# none can here.
FindDraft = Callable[[ModelFiles], Awaitable[Path | None]]


def draft_candidates(entries: Iterable[CatalogEntry], vocab: str, size: int) -> list[CatalogEntry]:
    """The catalogued models that could draft token for token for a target of `size` bytes
    whose tokens' list hashes to `vocab`: those with its vocabulary and at most
    `1/AUTO_RATIO` of its size, the largest first (a larger draft model is right more often,
    and still costs a sixth of a step or less)."""
    if not vocab:
        return []
    fit = [
        e
        for e in entries
        if e.is_add and e.vocab_sha256 == vocab and 0 < AUTO_RATIO * e.size <= size
    ]
    return sorted(fit, key=lambda e: (-e.size, e.name))


async def catalogued_draft(
    entries: Iterable[CatalogEntry],
    target: ModelFiles,
    *,
    need: Callable[[Path], int],
    free: Callable[[], int],
    get: Callable[[str], Path | None] = local_file,
) -> Path | None:
    """The file of the first of `draft_candidates` for `target` that this agent has or can
    get (`get`: a catalogued source's file, blocking), whose sha256 is the catalogued one
    and whose memory (`need`: weights and KV cache) fits in what is `free` now; None where
    none does. Each one passed over is logged with the reason."""
    vocab, size = target.layout.vocab_sha256, target.info.size_bytes
    for e in draft_candidates(entries, vocab, size):
        why = ""
        try:
            path = await trio.to_thread.run_sync(get, e.source)
            if path is None:
                why = "its file is not here and cannot be downloaded"
            elif await trio.to_thread.run_sync(target.store.source_sha256, path) != e.sha256:
                why = f"the file here ({path}) is not the catalogued one (sha256 differs)"
            elif (n := await trio.to_thread.run_sync(need, path)) > (left := free()):
                why = f"it needs {wording.size(n)}, {wording.size(left)} are free"
        except (MeshError, OSError) as err:
            why = str(err)
        if why:
            log.info("draft_model.passed_over", model=e.name, target=target.info.id, why=why)
            continue
        log.info("draft_model.chosen", model=e.name, target=target.info.id, path=str(path))
        return path
    return None


async def load_draft(
    settings: ServingSettings,
    target: TokenModel,
    target_bytes: int,
    find: Callable[[], Awaitable[Path | None]] | None = None,
) -> tuple[LlamaEngine, DraftModel] | tuple[None, None]:
    """The draft model's engine (a slot for each of the target's slots, at its context) and
    its proposals for `target` (a model of `target_bytes`), token for token where the two
    share a vocabulary, else by their text. With `auto`, the file `find` gives (a catalogued
    model of the target's vocabulary), else the embedded one where the target is at least
    `AUTO_RATIO` times its size, else none. The caller closes the engine once the target's
    runner is stopped."""
    path = draft_model_path(settings.draft_model)
    if settings.draft_model == "auto":
        found = await find() if find is not None else None
        if found is not None:
            path = found
        elif target_bytes < AUTO_RATIO * path.stat().st_size:
            log.info("draft_model.none", target=target.info.id, why="auto: the target is too small")
            return None, None
    engine = await trio.to_thread.run_sync(
        lambda: LlamaEngine(
            path, slots=settings.slots, slot_ctx=settings.slot_ctx, threads=settings.threads
        )
    )
    try:
        same = await trio.to_thread.run_sync(same_vocabulary, engine, target)
    except BaseException:
        engine.close()
        raise
    log.info(
        "draft_model.loaded", model=engine.info.id, target=target.info.id, same_vocabulary=same
    )
    return engine, DraftModel(engine, target, same_vocab=same)
