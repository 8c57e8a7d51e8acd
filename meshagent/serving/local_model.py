"""A model this agent serves (whole, or as the entry of a split): tokens, runner and chat
template together."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import trio

from meshagent.engine.base import Engine, ModelInfo, TokenModel
from meshagent.serving.chat import ChatMessage, ChatTemplate
from meshagent.serving.draft_model import DraftModel
from meshagent.serving.embeddings import Embedder
from meshagent.serving.executor import LocalExecutor
from meshagent.serving.generation import Delta, Finished, GenerationRequest, generate
from meshagent.serving.recovery import Recovery, RouteFinder
from meshagent.serving.runner import ModelRunner


class LocalModel:
    """`engine` answers the text side (tokens, template); `runner` computes. `whole` builds
    one for a whole model; the entry of a split passes its pipeline's runner, and its owner
    sets `routes` so that requests survive a lost stage, each within `replay_deadline`
    seconds of the loss (`serving/recovery.py`)."""

    routes: RouteFinder | None = None
    replay_deadline: float = 30.0
    speculation: str = "off"  # for requests that do not choose (`--speculation`)
    embedder: Embedder | None = None  # a model served whole embeds text (`/v1/embeddings`)

    def __init__(self, engine: TokenModel, runner: ModelRunner) -> None:
        self.engine = engine
        self.info: ModelInfo = engine.info
        self.runner = runner
        self.template = ChatTemplate.for_model(engine)

    @classmethod
    def whole(
        cls,
        engine: Engine,
        *,
        max_queue: int,
        prefix_budget: int = 0,
        draft: DraftModel | None = None,
    ) -> LocalModel:
        """`prefix_budget`: bytes of ended requests' KV it keeps for later prompts; `draft`:
        a draft model whose proposals speculating requests verify (`serving/model_drafts.py`)."""
        runner = ModelRunner(
            LocalExecutor(engine, prefix_budget=prefix_budget),
            max_queue=max_queue,
            is_end=engine.is_end_of_generation,
            token_bytes=engine.token_bytes,
        )
        runner.scheduler.drafting.model = draft
        return cls(engine, runner)

    def matches(self, name: str) -> bool:
        return name.casefold() == self.info.id.casefold()

    def chat_tokens(self, messages: Sequence[ChatMessage], **extra: Any) -> tuple[int, ...]:
        """The prompt of a conversation (`extra`: more template variables, e.g. tools)."""
        text = self.template.render(messages, **extra)
        # The template writes the BOS token itself when the model wants one.
        return tuple(self.engine.tokenize(text, add_bos=False))

    def text_tokens(self, prompt: str) -> tuple[int, ...]:
        return tuple(self.engine.tokenize(prompt, add_bos=True))

    async def generate(
        self, request: GenerationRequest, out: trio.MemorySendChannel[Delta | Finished]
    ) -> None:
        """Generate `request` into `out` (see `generation.generate`)."""
        if request.speculation is None:
            request = replace(request, speculation=self.speculation)
        recovery = None
        if self.routes is not None:
            recovery = Recovery(self.replay_deadline, routes=self.routes)
        await generate(self.runner, self.engine.token_bytes, request, out, recovery=recovery)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.runner.run(task_status=task_status)
