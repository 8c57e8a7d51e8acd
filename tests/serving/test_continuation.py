"""A request continued on another entry, on fakes: the deltas name the tokens behind them, and
a request given the tokens and characters a client already has goes on with exactly the text
the first entry would have sent (greedy, seeded, with stop strings), sending nothing twice."""

from __future__ import annotations

from dataclasses import replace

import pytest
import trio

from meshagent.serving.generation import Delta, Finished, GenerationRequest
from meshagent.serving.local_model import LocalModel
from meshagent.serving.sampling import SamplingParams
from meshagent.testing.fake_engine import FakeEngine

GREEDY = SamplingParams(temperature=0.0)
WARM = SamplingParams(temperature=0.9, top_p=0.95, seed=99, frequency_penalty=0.2)


async def events_of(model: LocalModel, request: GenerationRequest) -> list[Delta | Finished]:
    send, recv = trio.open_memory_channel(1000)
    async with send:
        await model.generate(request, send)
    return [e async for e in recv]


@pytest.fixture
async def model(nursery):
    local = LocalModel.whole(FakeEngine(slots=2), max_queue=4)
    await nursery.start(local.run)
    return local


def request(model: LocalModel, sampling: SamplingParams, stop=()) -> GenerationRequest:
    return GenerationRequest(model.text_tokens("omega"), 60, sampling, stop)


@pytest.mark.parametrize("sampling", [GREEDY, WARM], ids=["greedy", "seeded"])
async def test_every_generated_token_is_named_by_exactly_one_delta(model, sampling):
    events = await events_of(model, request(model, sampling))
    *deltas, done = events
    tokens = [t for d in deltas for t in d.tokens]
    assert len(tokens) == done.completion_tokens == 60
    text = b"".join(model.engine.token_bytes(t) for t in tokens).decode()
    assert text == "".join(d.text for d in deltas)


@pytest.mark.parametrize("sampling", [GREEDY, WARM], ids=["greedy", "seeded"])
@pytest.mark.parametrize("stop", [(), ("e",), ("zz", "q ")], ids=["no-stop", "stop", "stops"])
async def test_a_continuation_from_any_delta_gives_the_rest_of_the_same_text(model, sampling, stop):
    whole = request(model, sampling, stop)
    *deltas, done = await events_of(model, whole)
    text = "".join(d.text for d in deltas)
    for cut in range(len(deltas)):
        history = tuple(t for d in deltas[:cut] for t in d.tokens)
        delivered = sum(len(d.text) for d in deltas[:cut])
        cont = replace(whole, history=history, delivered=delivered)
        *more, finished = await events_of(model, cont)
        assert text[:delivered] + "".join(d.text for d in more) == text, cut
        assert (finished.reason, finished.completion_tokens) == (
            done.reason,
            done.completion_tokens,
        )
        # What follows names only tokens after the history.
        assert tuple(t for d in more for t in d.tokens) == tuple(
            t for d in deltas[cut:] for t in d.tokens
        )


async def test_text_of_the_history_the_client_lacks_is_sent_first(model):
    whole = request(model, GREEDY)
    *deltas, _ = await events_of(model, whole)
    history = tuple(t for d in deltas[:10] for t in d.tokens)
    have = sum(len(d.text) for d in deltas[:7])
    *more, _ = await events_of(model, replace(whole, history=history, delivered=have))
    assert more[0].text == "".join(d.text for d in deltas[7:10])
    assert more[0].tokens == ()  # those tokens were named before
    assert "".join(d.text for d in deltas[:7] + more) == "".join(d.text for d in deltas)


async def test_a_continuation_that_already_reached_its_end_computes_nothing(model):
    whole = request(model, GREEDY)
    *deltas, _ = await events_of(model, whole)
    tokens = tuple(t for d in deltas for t in d.tokens)
    text = "".join(d.text for d in deltas)
    before = model.runner.stats().tokens_processed
    full = replace(whole, history=tokens, delivered=len(text))
    events = await events_of(model, full)
    assert events == [Finished("length", len(whole.prompt_tokens), 60)]
    stop = text[20:22]  # the history ran into a stop string: the text up to it was sent
    stopped = replace(whole, stop=(stop,), history=tokens, delivered=text.index(stop))
    events = await events_of(model, stopped)
    assert events == [Finished("stop", len(whole.prompt_tokens), 60, stop=stop)]
    assert model.runner.stats().tokens_processed == before
