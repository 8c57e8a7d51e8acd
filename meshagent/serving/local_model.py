"""A model this agent serves whole: engine, batcher and chat template together."""

from __future__ import annotations

from collections.abc import Sequence

import trio

from meshagent.engine.base import Engine, ModelInfo
from meshagent.serving.batcher import Batcher
from meshagent.serving.chat import ChatMessage, ChatTemplate


class LocalModel:
    def __init__(self, engine: Engine, *, max_queue: int, batcher: Batcher | None = None) -> None:
        self.engine = engine
        self.info: ModelInfo = engine.info
        self.batcher = batcher or Batcher(engine, max_queue=max_queue)
        self.template = ChatTemplate(
            engine.info.chat_template,
            bos_token=engine.info.bos_token,
            eos_token=engine.info.eos_token,
        )

    def matches(self, name: str) -> bool:
        return name.casefold() == self.info.id.casefold()

    def chat_tokens(self, messages: Sequence[ChatMessage]) -> tuple[int, ...]:
        text = self.template.render(messages)
        # The template writes the BOS token itself when the model wants one.
        return tuple(self.engine.tokenize(text, add_bos=False))

    def text_tokens(self, prompt: str) -> tuple[int, ...]:
        return tuple(self.engine.tokenize(prompt, add_bos=True))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.batcher.run(task_status=task_status)
