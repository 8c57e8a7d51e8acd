"""Continuous batching on the real llama.cpp engine (the policy itself is tested on the fake
engine in test_runner.py and test_scheduler.py)."""

from __future__ import annotations

import pytest
import trio

from meshagent.errors import ContextOverflow
from meshagent.serving.chat import ChatMessage
from meshagent.serving.generation import Delta, Finished, GenerationRequest
from meshagent.serving.local_model import LocalModel
from meshagent.serving.sampling import SamplingParams

PROMPTS = ["Write a poem about the sea.", "Explain gravity.", "List three fruits.", "Hi!"]


async def run_one(model: LocalModel, prompt: str, max_tokens: int = 24) -> tuple[str, Finished]:
    req = GenerationRequest(
        model.chat_tokens([ChatMessage("user", prompt)]), max_tokens, SamplingParams(0.0)
    )
    send, recv = trio.open_memory_channel(max_tokens + 4)
    async with send:
        await model.generate(req, send)
    events = [ev async for ev in recv]
    assert isinstance(events[-1], Finished)
    return "".join(e.text for e in events if isinstance(e, Delta)), events[-1]


@pytest.fixture
async def model(engine, nursery):
    m = LocalModel.whole(engine, max_queue=2)
    await nursery.start(m.run)
    return m


async def test_interleaved_sequences_match_each_run_alone(model):
    alone = [await run_one(model, p) for p in PROMPTS]
    together: dict[int, tuple[str, Finished]] = {}
    batches_before = model.runner.stats().batches

    async def one(i: int) -> None:
        together[i] = await run_one(model, PROMPTS[i])

    async with trio.open_nursery() as n:
        for i in range(len(PROMPTS)):
            n.start_soon(one, i)
    assert [together[i] for i in range(len(PROMPTS))] == alone
    # They really ran together: far fewer engine calls than tokens generated.
    tokens = sum(f.completion_tokens for _, f in alone)
    assert model.runner.stats().batches - batches_before < tokens * 0.6


async def test_cancelled_request_frees_its_slot(model):
    with trio.move_on_after(0.3):
        await run_one(model, "Tell me a very long story.", max_tokens=400)
    # Freed at once, or (its token being computed) when the step it is in returns.
    with trio.fail_after(10):
        while model.runner.stats().active:
            await trio.sleep(0.01)
    # The freed slot is clean: the same prompt gives the same answer as before.
    assert await run_one(model, PROMPTS[2]) == await run_one(model, PROMPTS[2])


async def test_a_request_past_the_slot_is_refused(model):
    too_long = GenerationRequest((1,) * (model.runner.slot_ctx + 1), 4, SamplingParams(0.0))
    send, _ = trio.open_memory_channel(8)
    with pytest.raises(ContextOverflow):
        await model.generate(too_long, send)
