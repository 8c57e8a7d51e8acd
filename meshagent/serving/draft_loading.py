"""Loading the draft model an agent was given (`meshagent up --draft-model PATH`) beside the
model it serves: whole, or as a split's entry (the draft model runs where requests enter)."""

from __future__ import annotations

from pathlib import Path

import structlog
import trio

from meshagent.engine.base import TokenModel
from meshagent.engine.llama import LlamaEngine
from meshagent.serving.draft_model import DraftModel, same_vocabulary
from meshagent.serving.settings import ServingSettings

log = structlog.get_logger(__name__)


async def load_draft(
    settings: ServingSettings, target: TokenModel
) -> tuple[LlamaEngine, DraftModel]:
    """The draft model's engine (a slot for each of the target's slots, at its context) and
    its proposals for `target`, token for token where the two share a vocabulary, else by
    their text. The caller closes the engine once the target's runner is stopped."""
    path = Path(settings.draft_model).expanduser()
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
