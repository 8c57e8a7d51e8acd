"""Loading the draft model an agent was given (`meshagent up --draft-model`) beside a model it
serves: whole, or as a split's entry (the draft model runs where requests enter)."""

from __future__ import annotations

import structlog
import trio

from meshagent.engine.base import TokenModel
from meshagent.engine.llama import LlamaEngine
from meshagent.models.default import draft_model_path
from meshagent.serving.draft_model import DraftModel, same_vocabulary
from meshagent.serving.settings import ServingSettings

log = structlog.get_logger(__name__)

# `--draft-model auto` drafts for targets at least this many times the draft model's size: a
# forward pass of a model a sixth of the target's size costs about a sixth of the target's
# step, and a window of its drafts then pays where several are right.
AUTO_RATIO = 6


async def load_draft(
    settings: ServingSettings, target: TokenModel, target_bytes: int
) -> tuple[LlamaEngine, DraftModel] | tuple[None, None]:
    """The draft model's engine (a slot for each of the target's slots, at its context) and
    its proposals for `target` (a model of `target_bytes`), token for token where the two
    share a vocabulary, else by their text; with `auto`, none where the target is less than
    `AUTO_RATIO` times the draft's size. The caller closes the engine once the target's
    runner is stopped."""
    path = draft_model_path(settings.draft_model)
    if settings.draft_model == "auto" and target_bytes < AUTO_RATIO * path.stat().st_size:
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
