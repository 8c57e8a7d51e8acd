from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from meshagent.engine.llama import LlamaEngine
from meshagent.serving.chat import ChatMessage
from meshagent.serving.generation import Delta, Finished, GenerationRequest
from meshagent.serving.local_model import LocalModel
from meshagent.serving.sampling import SamplingParams

PROMPTS = ["Write a haiku about rivers.", "What is 7 times 8?", "Name three colours.", "Hi"]


@pytest.fixture(scope="session")
def engine(model_path: Path) -> Iterator[LlamaEngine]:
    eng = LlamaEngine(model_path, slots=4, slot_ctx=512)
    yield eng
    eng.close()


async def text_of(model: LocalModel, prompt: str, max_tokens: int = 40, **sampling) -> str:
    tokens = model.chat_tokens([ChatMessage("user", prompt)])
    params = SamplingParams(**({"temperature": 0.0} | sampling))
    send, recv = trio.open_memory_channel(max_tokens + 4)
    async with send:
        await model.generate(GenerationRequest(tokens, max_tokens, params), send)
    events = [e async for e in recv]
    assert isinstance(events[-1], Finished)
    return "".join(e.text for e in events if isinstance(e, Delta))


@pytest.fixture(scope="session")
def reference(model_path):
    """Greedy answers of single-process llama.cpp (flash attention off, as agents run it)."""
    engine = LlamaEngine(model_path, slots=1, slot_ctx=1024, flash_attn=False)
    model = LocalModel.whole(engine, max_queue=8)

    async def main():
        async with trio.open_nursery() as n:
            await n.start(model.run)
            out = [await text_of(model, p) for p in PROMPTS]
            n.cancel_scope.cancel()
        return out

    try:
        return trio.run(main)
    finally:
        engine.close()
