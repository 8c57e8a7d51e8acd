"""A model split over three overlay nodes on loopback TCP serves exactly what llama.cpp serves."""

from __future__ import annotations

import time

import httpx
import pytest
import trio

from meshagent.api.app import SPLIT_RETRY_AFTER, OpenAIApp
from meshagent.api.inflight import InFlight
from meshagent.engine.llama import LlamaEngine
from meshagent.engine.stage import StageEngine
from meshagent.errors import EngineError, SplitUnavailable
from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret
from meshagent.models.layout import inspect_model
from meshagent.net.manager import ConnectionManager
from meshagent.net.tcp import TcpTransport
from meshagent.serving.generation import Delta, GenerationRequest
from meshagent.serving.local_model import LocalModel
from meshagent.serving.pipeline import (
    ACTIVATION_WINDOW_BYTES,
    ACTIVATION_WINDOW_FRAMES,
    REPLY_LABEL,
    STAGE_LABEL,
    EntryEngine,
    PipelineExecutor,
)
from meshagent.serving.runner import ModelRunner
from meshagent.serving.sampling import SamplingParams
from meshagent.serving.stage_server import StageServer
from meshagent.wire.handshake import LocalPeer
from tests.api.test_forwarding import StaticDirectory, serve
from tests.serving.conftest import PROMPTS, text_of
from tests.serving.stages import ROOMY, SameRoute

MESH = MeshSecret.generate()
SPLIT = [(0, 10), (10, 20), (20, 30)]


async def start_split(nursery, model_path, store, wire: str, *, slots: int = 4, depth: int = 1):
    """Three nodes: the entry runs layers 0-10, the others 10-20 and 20-30."""
    layout = inspect_model(model_path)
    stages = [
        StageEngine(
            store.ensure_layers(model_path, a, b, layout)[0],
            start=a,
            end=b,
            total_layers=30,
            slots=slots,
            slot_ctx=1024,
            threads=1,  # three stages share this process's cores; spinning threads would fight
        )
        for a, b in SPLIT
    ]
    entry_path, _ = store.ensure_entry(model_path, layout)
    whole = LlamaEngine(model_path, slots=1, slot_ctx=256)
    info = whole.info
    whole.close()
    entry_engine = EntryEngine(entry_path, stages[0], info)
    nodes = [
        ConnectionManager(
            LocalPeer.create(NodeIdentity.generate(), MESH), TcpTransport(), listen=["127.0.0.1:0"]
        )
        for _ in range(3)
    ]
    a, b, c = nodes
    window = {"window_bytes": ACTIVATION_WINDOW_BYTES, "window_frames": ACTIVATION_WINDOW_FRAMES}
    pipeline = PipelineExecutor(
        entry_engine,
        lambda: a.open_stream(b.peer_id, STAGE_LABEL, **window),
        wire_dtype=wire,
        depth=depth,
    )
    servers = [
        StageServer(
            stages[1],
            n_vocab=info.n_vocab,
            kept_budget=ROOMY,
            open_next=lambda: b.open_stream(c.peer_id, STAGE_LABEL, **window),
            open_reply=None,
        ),
        StageServer(
            stages[2],
            n_vocab=info.n_vocab,
            kept_budget=ROOMY,
            open_next=None,
            open_reply=lambda: c.open_stream(a.peer_id, REPLY_LABEL),
        ),
    ]
    a._on_stream = pipeline.handle_reply
    b._on_stream = servers[0].handle
    c._on_stream = servers[1].handle
    for node in nodes:
        await nursery.start(node.run)
    await a.dial(b.listen_addresses[0], peer_id=b.peer_id)
    await b.dial(c.listen_addresses[0], peer_id=c.peer_id)
    await c.dial(a.listen_addresses[0], peer_id=a.peer_id)
    runner = ModelRunner(pipeline, max_queue=8, is_end=entry_engine.is_end_of_generation)
    model = LocalModel(entry_engine, runner)
    await nursery.start(model.run)
    return model, nodes, servers, stages


async def all_at_once(model: LocalModel) -> list[str]:
    """Every prompt's answer, the requests sent all at once."""
    got: dict[int, str] = {}

    async def one(i: int) -> None:
        got[i] = await text_of(model, PROMPTS[i])

    async with trio.open_nursery() as n:
        for i in range(len(PROMPTS)):
            n.start_soon(one, i)
    return [got[i] for i in range(len(PROMPTS))]


async def test_split_over_three_nodes_matches_llama_cpp(model_path, store, reference, nursery):
    model, *_ = await start_split(nursery, model_path, store, "f32")
    assert [await text_of(model, p) for p in PROMPTS] == reference


async def test_concurrent_requests_all_match(model_path, store, reference, nursery):
    model, _, servers, _ = await start_split(nursery, model_path, store, "f32")
    assert await all_at_once(model) == reference
    # Depth 1: requests share steps (how many, depends on when each arrives; that a depth-1
    # step takes every ready sequence is checked deterministically on fakes,
    # test_pipeline_fake.py::test_one_group_in_a_shallow_pipeline).
    assert model.runner.largest_step > 1
    # Requests shared rounds: far fewer stage calls than tokens generated.
    tokens = sum(len(model.engine.tokenize(t, add_bos=False)) for t in reference)
    assert servers[1].forwards < tokens


async def test_groups_take_turns_in_a_deep_pipeline_and_all_match(
    model_path, store, reference, nursery
):
    model, _, _, _ = await start_split(nursery, model_path, store, "f32", depth=3)
    assert await all_at_once(model) == reference
    # Four requests over three stages: a round takes at most 4 // 3 = 1 sequence, so each
    # travels as a group of its own and several are in flight at once.
    assert model.runner.largest_step == 1
    assert model.runner.peak_steps_in_flight >= 3


async def test_seeded_sampling_is_reproducible_across_the_split(model_path, store, nursery):
    model, *_ = await start_split(nursery, model_path, store, "f16")
    a = await text_of(model, PROMPTS[0], temperature=0.9, seed=5)
    b = await text_of(model, PROMPTS[0], temperature=0.9, seed=5)
    assert a == b and a


async def test_a_dead_stage_fails_requests_instead_of_hanging(model_path, store, nursery):
    model, nodes, _, _ = await start_split(nursery, model_path, store, "f16")
    assert await text_of(model, PROMPTS[3], max_tokens=4)
    await nodes[2].aclose(grace=0)  # the last stage goes away
    with trio.fail_after(20), pytest.raises(SplitUnavailable, match="split pipeline failed"):
        await text_of(model, PROMPTS[1], max_tokens=8)


async def test_a_lost_stage_is_a_503_with_retry_after_over_http(model_path, store, nursery):
    model, nodes, _, _ = await start_split(nursery, model_path, store, "f16")
    url, stop = await serve(nursery, OpenAIApp(StaticDirectory([model]), InFlight(), lambda: {}))
    body = {"model": model.info.id, "prompt": "Hi", "max_tokens": 4}
    async with httpx.AsyncClient(timeout=60) as client:
        assert (await client.post(f"{url}/v1/completions", json=body)).status_code == 200
        await nodes[2].aclose(grace=0)  # the last stage goes away
        with trio.fail_after(30):
            r = await client.post(f"{url}/v1/completions", json=body)
    # Temporary, and said so: the client may retry after the time given.
    assert r.status_code == 503
    assert r.headers["retry-after"] == str(SPLIT_RETRY_AFTER)
    error = r.json()["error"]
    assert error["code"] == "split_unavailable" and error["type"] == "server_error"
    assert error["message"].startswith("the split pipeline failed")
    stop.set()


async def test_the_split_serves_again_when_its_lost_stage_comes_back(
    model_path, store, reference, nursery
):
    model, nodes, servers, _ = await start_split(nursery, model_path, store, "f32")
    a, b, c = nodes
    assert await text_of(model, PROMPTS[3], max_tokens=4)
    await c.aclose(grace=0)  # the last stage's agent goes away...
    with trio.fail_after(20), pytest.raises(EngineError, match="split pipeline failed"):
        await text_of(model, PROMPTS[1], max_tokens=8)
    # ...and comes back with the same identity, under the same plan: no reload anywhere.
    back = ConnectionManager(c.local, TcpTransport(), listen=["127.0.0.1:0"])
    servers[1]._open_reply = lambda: back.open_stream(a.peer_id, REPLY_LABEL)
    back._on_stream = servers[1].handle
    await nursery.start(back.run)
    await back.dial(a.listen_addresses[0], peer_id=a.peer_id)
    await b.dial(back.listen_addresses[0], peer_id=back.peer_id)
    with trio.fail_after(60):
        assert [await text_of(model, p) for p in PROMPTS] == reference


async def test_a_break_while_the_first_stage_computes_fails_that_batch_only(
    model_path, store, reference, nursery
):
    model, *_ = await start_split(nursery, model_path, store, "f32")
    pipeline = model.runner.executor
    run_first = pipeline.entry.run_first

    def slow_first(items):
        time.sleep(0.5)
        return run_first(items)

    pipeline.entry.run_first = slow_first
    async with trio.open_nursery() as n:

        async def request() -> None:
            with pytest.raises(EngineError, match="split pipeline failed: test break"):
                await text_of(model, PROMPTS[1], max_tokens=8)

        n.start_soon(request)
        await trio.sleep(0.2)  # the first stage is computing this request's prompt
        pipeline.chain.break_("test break")
    pipeline.entry.run_first = run_first
    # The runner survived; the next request reconnects the chain and is served as before.
    with trio.fail_after(60):
        assert await text_of(model, PROMPTS[0]) == reference[0]


async def test_a_request_in_flight_survives_a_broken_chain(model_path, store, nursery):
    """The chain breaks mid-request; the entry reconnects and replays the prompt and the
    tokens so far: the greedy text is the undisturbed run's. (Seeded sampling at temperature
    0.8 is not checked here: llama.cpp's prefill of the replayed tokens is not bit-identical to
    decoding them one by one, and the text can drift; see docs/serving.md.)"""
    model, *_ = await start_split(nursery, model_path, store, "f32")

    model.routes = SameRoute(model)
    tokens = model.text_tokens("1, 2, 3, 4, 5, 6,")

    async def run(params, *, break_after=None):
        send, recv = trio.open_memory_channel(100)

        async def generate():
            async with send:
                await model.generate(GenerationRequest(tokens, 80, params), send)

        async with trio.open_nursery() as n:
            n.start_soon(generate)
            if break_after is not None:
                base = model.runner.stats().tokens_processed
                while model.runner.stats().tokens_processed < base + len(tokens) + break_after:
                    await trio.sleep(0.001)
                while not model.runner.busy():
                    await trio.sleep(0)
                model.runner.executor.interrupt("a stage's peer is gone")
            events = [e async for e in recv]
        return "".join(e.text for e in events if isinstance(e, Delta)), events[-1]

    greedy = SamplingParams(temperature=0.0)
    expected, _ = await run(greedy)
    got, done = await run(greedy, break_after=40)
    assert got == expected
    [replay] = done.replays
    assert replay.tokens == len(tokens) + 40
