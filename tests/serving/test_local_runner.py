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


async def run_one(
    model: LocalModel, prompt: str | list[ChatMessage], max_tokens: int = 24
) -> tuple[str, Finished]:
    messages = [ChatMessage("user", prompt)] if isinstance(prompt, str) else prompt
    req = GenerationRequest(model.chat_tokens(messages), max_tokens, SamplingParams(0.0))
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


SYSTEM = (
    "You are a patient teacher. You answer in two short sentences, you never use lists, and "
    "you always mention one fact about the ocean before you answer the question itself. "
)


async def test_kept_prefixes_give_the_same_text_on_llama_cpp(engine, nursery):
    # The same requests on one engine with and without kept prefixes: restored KV (from
    # prompts chunked and decoded in other batches) must give the tokens a prefill gives.
    cached = LocalModel.whole(engine, max_queue=4, prefix_budget=64 << 20)
    asks = ("Why is the sky blue?", "What is rain?", "Why is the sky blue?")
    prompts = [SYSTEM + q for q in asks]
    async with trio.open_nursery() as n:
        await n.start(cached.run)
        assert cached.runner.executor.prefix_reason == "on"
        with_cache = [await run_one(cached, p, 32) for p in prompts]
        turn2 = [
            ChatMessage("user", prompts[0]),
            ChatMessage("assistant", with_cache[0][0]),
            ChatMessage("user", "And at night?"),
        ]
        with_cache.append(await run_one(cached, turn2, 32))
        n.cancel_scope.cancel()
    plain = LocalModel.whole(engine, max_queue=4)
    async with trio.open_nursery() as n:
        await n.start(plain.run)
        without = [await run_one(plain, p, 32) for p in [*prompts, turn2]]
        n.cancel_scope.cancel()
    assert [t for t, _ in with_cache] == [t for t, _ in without]
    cached_tokens = [f.cached_tokens for _, f in with_cache]
    system = len(cached.chat_tokens([ChatMessage("user", SYSTEM)])) - 8  # the template's tail
    assert cached_tokens[0] == 0
    assert cached_tokens[1] >= system
    assert cached_tokens[2] == with_cache[2][1].prompt_tokens - 1  # all but the last token
    assert cached_tokens[3] >= with_cache[0][1].prompt_tokens  # the first turn (and its reply)


def test_a_kept_prefix_costs_the_bytes_measured_at_load(engine):
    from meshagent.engine.base import ForwardItem
    from meshagent.serving.executor import measure_kept_size

    size = measure_kept_size(engine)
    tokens = engine.tokenize(SYSTEM * 3, add_bos=True)
    engine.clear_sequence(1)
    try:
        engine.forward([ForwardItem(1, 0, tokens, False)])
        for n in (len(tokens), 100, 17):
            assert len(engine.export_sequence(1, n)) == size(n)
    finally:
        engine.clear_sequence(1)
