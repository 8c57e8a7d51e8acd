"""The runner and the local executor on the fake engine: generation, batching, cancellation,
queueing and failures, in milliseconds."""

from __future__ import annotations

import time

import pytest
import trio

from meshagent.errors import EngineError, QueueFull, ShuttingDown
from meshagent.serving import runner as runner_module
from meshagent.serving.executor import NOTHING_YET
from meshagent.serving.generation import Delta, Finished, GenerationRequest
from meshagent.serving.local_model import LocalModel
from meshagent.serving.runner import ModelRunner
from meshagent.serving.sampling import SamplingParams
from meshagent.testing.fake_engine import FakeEngine, fake_logits

GREEDY = SamplingParams(temperature=0.0)


async def complete(model: LocalModel, prompt: str, max_tokens: int = 12, **kw):
    params = kw.pop("sampling", GREEDY)
    req = GenerationRequest(model.text_tokens(prompt), max_tokens, params, **kw)
    send, recv = trio.open_memory_channel(max_tokens + 4)
    async with send:
        await model.generate(req, send)
    events = [e async for e in recv]
    assert isinstance(events[-1], Finished)
    return "".join(e.text for e in events if isinstance(e, Delta)), events[-1]


def expected(engine: FakeEngine, prompt: str, n: int) -> str:
    """Greedy text computed straight from the fake's arithmetic, token by token."""
    held = engine.tokenize(prompt, add_bos=True)
    out = b""
    for _ in range(n):
        tok = int(fake_logits(held, engine.n_vocab).argmax())
        out += engine.token_bytes(tok)
        held.append(tok)
    return out.decode()


@pytest.fixture
async def served(nursery):
    engine = FakeEngine(slots=3, delay=0.001)
    model = LocalModel.whole(engine, max_queue=2)
    await nursery.start(model.run)
    return engine, model


async def test_greedy_text_is_the_models(served):
    engine, model = served
    text, fin = await complete(model, "hello", 10)
    assert text == expected(engine, "hello", 10)
    assert (fin.reason, fin.prompt_tokens, fin.completion_tokens) == ("length", 6, 10)


async def test_concurrent_requests_batch_and_match_each_alone(served):
    _, model = served
    prompts = ["one", "two", "three"]
    alone = [await complete(model, p, 20) for p in prompts]
    before = model.runner.stats().batches
    got = {}

    async def one(i):
        got[i] = await complete(model, prompts[i], 20)

    async with trio.open_nursery() as n:
        for i in range(3):
            n.start_soon(one, i)
    assert [got[i] for i in range(3)] == alone
    assert model.runner.stats().batches - before < 60 * 0.6  # they shared steps


async def test_end_token_and_stop_strings_end_generation(nursery):
    engine = FakeEngine(eos_every=9)
    model = LocalModel.whole(engine, max_queue=2)
    await nursery.start(model.run)
    text, fin = await complete(model, "abc", 30)  # 4 prompt tokens + 5: the end token
    assert (fin.reason, fin.completion_tokens) == ("stop", 5)
    full = expected(FakeEngine(), "abc", 4)
    text, fin = await complete(model, "abc", 30, stop=(full[2:],))
    assert (text, fin.reason) == (full[:2], "stop")


async def test_seeded_sampling_is_reproducible(served):
    _, model = served
    hot = SamplingParams(temperature=1.5, seed=7)
    a = await complete(model, "seed", 16, sampling=hot)
    b = await complete(model, "seed", 16, sampling=hot)
    c = await complete(model, "seed", 16, sampling=SamplingParams(temperature=1.5, seed=8))
    assert a == b and a != c


async def test_cancelled_request_frees_its_slot_and_leaves_it_clean(served):
    engine, model = served
    with trio.move_on_after(0.02):
        await complete(model, "long", 200)
    for _ in range(100):
        if model.runner.stats().active == 0:
            break
        await trio.sleep(0.005)
    assert model.runner.stats().active == 0
    assert (await complete(model, "again", 8))[0] == expected(engine, "again", 8)


async def test_queue_bound_fifo_and_shutdown(nursery):
    engine = FakeEngine(slots=1, delay=0.002)
    model = LocalModel.whole(engine, max_queue=2)
    await nursery.start(model.run)
    order = []

    async def one(i):
        await complete(model, "x", 5)
        order.append(i)

    async with trio.open_nursery() as n:
        for i in range(3):  # one runs, two wait
            n.start_soon(one, i)
            await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(QueueFull):
            await complete(model, "y", 5)
        model.runner.close()
        with pytest.raises(ShuttingDown):
            await complete(model, "z", 5)
    assert order == [0, 1, 2]


async def test_an_engine_failure_fails_its_requests_not_the_runner(served):
    engine, model = served
    engine.fail_next = "device lost"
    with pytest.raises(EngineError, match="device lost"):
        await complete(model, "boom", 5)
    assert (await complete(model, "fine", 5))[0] == expected(engine, "fine", 5)


async def test_abort_fails_waiting_requests(nursery):
    engine = FakeEngine(slots=1, delay=0.01)
    model = LocalModel.whole(engine, max_queue=4)
    await nursery.start(model.run)
    errors = []

    async def one():
        try:
            await complete(model, "x", 100)
        except EngineError as e:
            errors.append(str(e))

    async with trio.open_nursery() as n:
        for _ in range(3):
            n.start_soon(one)
        await trio.sleep(0.05)
        model.runner.abort("moved")
    assert errors == ["moved"] * 3


class _LaterTokens:
    """An executor whose tokens come back later (as a split's do): it records its steps."""

    n_slots, slot_ctx, depth, max_windows = 1, 64, 1, 1
    speculates = exact_windows = False
    windows_reason = prefix_reason = ""
    prefix_budget, kept_size = 0, None

    def __init__(self) -> None:
        self.steps: list = []

    def run_step(self, step):
        self.steps.append(step)
        return NOTHING_YET

    async def run(self, sink, *, task_status):
        self.sink = sink
        task_status.started()


async def test_tokens_from_elsewhere_hand_the_worker_its_next_step_first(nursery, monkeypatch):
    # The event loop lets the idle worker take the next step before it delivers the token:
    # the step, not the text, is on the critical path. The wait ends when the worker has
    # its step (or finds none), not when the bound runs out.
    monkeypatch.setattr(runner_module, "_HANDOVER", 30.0)
    executor = _LaterTokens()
    runner = ModelRunner(executor, max_queue=1, is_end=lambda tok: False)
    await nursery.start(runner.run)
    handle = runner.start((1, 2, 3), 3, GREEDY)
    while not executor.steps:  # the prompt's step
        await trio.sleep(0.001)
    slot = executor.steps[0].items[0].slot
    for n, tok in enumerate((7, 8, 9), start=1):
        t0 = time.perf_counter()
        executor.sink.tokens([(slot, tok, (), None)])
        assert time.perf_counter() - t0 < 10  # the worker ended the wait
        if n < 3:  # it holds the step of the token just delivered
            assert runner.steps_in_flight() == 1
        assert (await handle.next()).token == tok
    assert handle.finished and runner.steps_in_flight() == 0
