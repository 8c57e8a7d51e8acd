"""A model this agent serves whole: engine, batcher and chat template together."""

from __future__ import annotations

from collections.abc import Sequence

import trio

from meshagent.engine.base import Engine, ModelInfo
from meshagent.serving.batcher import Batcher
from meshagent.serving.chat import ChatMessage, ChatTemplate
from meshagent.serving.generation import Delta, Finished, GenerationRequest, check_fits, generate


class LocalModel:
    def __init__(self, engine: Engine, *, max_queue: int) -> None:
        self.engine = engine
        self.info: ModelInfo = engine.info
        self.batcher = Batcher(engine, max_queue=max_queue)
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

    def open_generation(
        self, request: GenerationRequest
    ) -> tuple[trio.MemoryReceiveChannel[Delta | Finished], object]:
        """Check the request fits, then return (events, coroutine function to run it)."""
        limit = check_fits(request, self.engine.slot_ctx)
        send, receive = trio.open_memory_channel[Delta | Finished](limit + 2)

        async def run() -> None:
            async with send:
                await generate(self.batcher, request, send)

        return receive, run
