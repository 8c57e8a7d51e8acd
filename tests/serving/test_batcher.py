"""Continuous batching on the real llama.cpp engine."""

from __future__ import annotations

import pytest
import trio

from meshagent.errors import ContextOverflow, QueueFull, ShuttingDown
from meshagent.serving.batcher import Batcher
from meshagent.serving.chat import ChatMessage
from meshagent.serving.generation import Delta, Finished, GenerationRequest, generate
from meshagent.serving.local_model import LocalModel
from meshagent.serving.sampling import SamplingParams

PROMPTS = ["Write a poem about the sea.", "Explain gravity.", "List three fruits.", "Hi!"]


async def run_one(model: LocalModel, prompt: str, max_tokens: int = 24) -> tuple[str, Finished]:
    req = GenerationRequest(
        model.chat_tokens([ChatMessage("user", prompt)]), max_tokens, SamplingParams(0.0)
    )
    send, recv = trio.open_memory_channel(max_tokens + 4)
    async with send:
        await generate(model.batcher, req, send)
    events = [ev async for ev in recv]
    assert isinstance(events[-1], Finished)
    return "".join(e.text for e in events if isinstance(e, Delta)), events[-1]


@pytest.fixture
async def model(engine, nursery):
    m = LocalModel(engine, max_queue=2)
    await nursery.start(m.run)
    return m


async def test_interleaved_sequences_match_each_run_alone(model):
    alone = [await run_one(model, p) for p in PROMPTS]
    together: dict[int, tuple[str, Finished]] = {}
    batches_before = model.batcher.stats().batches

    async def one(i: int) -> None:
        together[i] = await run_one(model, PROMPTS[i])

    async with trio.open_nursery() as n:
        for i in range(len(PROMPTS)):
            n.start_soon(one, i)
    assert [together[i] for i in range(len(PROMPTS))] == alone
    # They really ran together: far fewer engine calls than tokens generated.
    tokens = sum(f.completion_tokens for _, f in alone)
    assert model.batcher.stats().batches - batches_before < tokens * 0.6


async def test_slots_are_granted_in_arrival_order(engine, nursery):
    batcher = Batcher(engine, max_queue=8)
    await nursery.start(batcher.run)
    order: list[int] = []
    holders = []
    for _ in range(engine.n_slots):  # fill every slot
        cm = batcher.sequence()
        await cm.__aenter__()
        holders.append(cm)

    async def waiter(i: int) -> None:
        async with batcher.sequence():
            order.append(i)

    async with trio.open_nursery() as n:
        for i in range(5):
            n.start_soon(waiter, i)
            await trio.testing.wait_all_tasks_blocked()
        assert batcher.stats().queued == 5
        # One slot comes free: it passes from waiter to waiter in the order they came.
        await holders.pop().__aexit__(None, None, None)
    assert order == [0, 1, 2, 3, 4]
    for cm in holders:
        await cm.__aexit__(None, None, None)


async def test_queue_bound_and_shutdown(engine, nursery):
    batcher = Batcher(engine, max_queue=1)
    await nursery.start(batcher.run)
    async with trio.open_nursery() as n:
        held = []
        for _ in range(engine.n_slots):
            cm = batcher.sequence()
            await cm.__aenter__()
            held.append(cm)
        n.start_soon(lambda: _hold_briefly(batcher))
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(QueueFull):
            async with batcher.sequence():
                pass
        batcher.close()
        with pytest.raises(ShuttingDown):
            async with batcher.sequence():
                pass
        for cm in held:
            await cm.__aexit__(None, None, None)


async def _hold_briefly(batcher: Batcher) -> None:
    async with batcher.sequence():
        pass


async def test_cancelled_request_frees_its_slot(model):
    with trio.move_on_after(0.3):
        await run_one(model, "Tell me a very long story.", max_tokens=400)
    await trio.testing.wait_all_tasks_blocked()
    for _ in range(100):
        if model.batcher.stats().active == 0:
            break
        await trio.sleep(0.01)
    assert model.batcher.stats().active == 0
    # The freed slot is clean: the same prompt gives the same answer as before.
    assert await run_one(model, PROMPTS[2]) == await run_one(model, PROMPTS[2])


async def test_feeding_past_the_slot_is_refused(model):
    async with model.batcher.sequence() as seq:
        with pytest.raises(ContextOverflow):
            await seq.feed([1] * (seq.capacity + 1))
