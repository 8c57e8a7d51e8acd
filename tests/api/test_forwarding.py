"""A request for a model served by another peer is carried there over the overlay."""

from __future__ import annotations

import httpx
import openai
import pytest
import trio
from openai import OpenAI

from meshagent.api import forwarding, resumable
from meshagent.api.app import OpenAIApp
from meshagent.api.inflight import InFlight
from meshagent.api.server import HttpBinding, serve_http
from meshagent.engine.llama import LlamaEngine
from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret
from meshagent.net.manager import ConnectionManager
from meshagent.net.tcp import TcpTransport
from meshagent.serving.directory import FORWARD_LABEL, GENERATE_LABEL, Headers, RemoteModel
from meshagent.serving.local_model import LocalModel
from meshagent.wire.handshake import LocalPeer

MESH = MeshSecret.generate()


class StaticDirectory:
    """A model directory that never changes: `local` served here with `receipt`, `remote`
    reached over `node`."""

    def __init__(
        self,
        local: list[LocalModel] | None = None,
        remote: list[RemoteModel] | None = None,
        *,
        node: ConnectionManager | None = None,
        receipt: Headers | None = None,
    ) -> None:
        self.local = local or []
        self.remote = remote or []
        self.node = node
        self._receipt = receipt or []

    def local_models(self) -> list[LocalModel]:
        return self.local

    def remote_models(self) -> list[RemoteModel]:
        return self.remote

    def unserved_for_now(self, name: str) -> float:
        return 0.0

    def why_unserved(self, name: str) -> str | None:
        return None

    def receipt(self, model: LocalModel) -> Headers:
        return list(self._receipt)

    async def open_stream(self, peer_id: str, label: str = FORWARD_LABEL):
        assert self.node is not None
        return await self.node.open_stream(peer_id, label)


async def route_api(stream, app, *, labels=(FORWARD_LABEL, GENERATE_LABEL)) -> None:
    """Route an inbound stream as an agent does; an agent that predates `gen/1` serves only
    `api/1` (`labels`) and resets the rest."""
    if stream.label not in labels:
        stream.reset(f"no service for stream label {stream.label!r}")
    elif stream.label == GENERATE_LABEL:
        await resumable.serve(stream, app, peer_id=stream.peer_id)
    else:
        await forwarding.serve_forwarded(stream, app, peer_id=stream.peer_id)


async def serve(nursery, app) -> tuple[str, trio.Event]:
    """Serve `app` over HTTP on a free loopback port; set the event to stop."""
    stop = trio.Event()
    url = await nursery.start(
        lambda task_status: serve_http(
            app,
            HttpBinding("127.0.0.1", 0, graceful_timeout=1),
            shutdown_trigger=stop.wait,
            task_status=task_status,
        )
    )
    return url, stop


@pytest.fixture
async def two_agents(model_path, nursery):
    """A serves the model; B serves nothing itself and routes to A. Yields B's API URL."""
    engine = LlamaEngine(model_path, slots=2, slot_ctx=512)
    model = LocalModel.whole(engine, max_queue=4)
    serving = trio.CancelScope()
    stopped = trio.Event()

    async def run_model(task_status=trio.TASK_STATUS_IGNORED):
        with serving:
            await model.run(task_status=task_status)
        stopped.set()

    await nursery.start(run_model)
    receipt = [(b"x-meshagent-stages", b"a:0-30")]
    app_a = OpenAIApp(StaticDirectory([model], receipt=receipt), InFlight(), lambda: {})
    a = ConnectionManager(
        LocalPeer.create(NodeIdentity.generate(), MESH),
        TcpTransport(),
        listen=["127.0.0.1:0"],
        on_stream=lambda s: route_api(s, app_a),
    )
    await nursery.start(a.run)
    b = ConnectionManager(LocalPeer.create(NodeIdentity.generate(), MESH), TcpTransport())
    await nursery.start(b.run)
    await b.dial(a.listen_addresses[0], peer_id=a.peer_id)
    remote = RemoteModel(model.info.id, a.peer_id, "whole", layers=30, context_length=512)
    app_b = OpenAIApp(StaticDirectory(remote=[remote], node=b), InFlight(), lambda: {})
    url, stop = await serve(nursery, app_b)
    yield url, model, a
    stop.set()
    serving.cancel()  # the runner stops before its engine is freed
    await stopped.wait()
    engine.close()


async def test_chat_through_a_peer_streams_and_matches(two_agents, model_id):
    url, *_ = two_agents
    client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "Name a fruit."}]

    def ask():
        whole = client.chat.completions.create(
            model=model_id, messages=msgs, max_tokens=16, temperature=0
        )
        parts = [
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=model_id, messages=msgs, max_tokens=16, temperature=0, stream=True
            )
        ]
        listed = [m.id for m in client.models.list().data]
        return whole, "".join(parts), listed

    whole, streamed, listed = await trio.to_thread.run_sync(ask)
    assert whole.choices[0].message.content == streamed
    assert whole.usage.completion_tokens > 0
    assert listed == [model_id]


async def test_the_serving_agents_receipt_comes_back_with_who_served(two_agents, model_id):
    url, _, a = two_agents
    body = {"model": model_id, "prompt": "Hi", "max_tokens": 2}
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200
    assert r.headers["x-meshagent-stages"] == "a:0-30"  # the directory's receipt, at A
    assert r.headers["x-meshagent-served-by"] == a.peer_id  # added by B, which forwarded


async def test_errors_come_back_with_their_status(two_agents, model_id):
    url, *_ = two_agents
    client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)

    def overflow():
        client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=100_000
        )

    with pytest.raises(openai.BadRequestError) as exc:
        await trio.to_thread.run_sync(overflow)
    assert exc.value.body["code"] == "context_length_exceeded"


async def test_a_client_gone_mid_stream_frees_the_remote_slot(two_agents, model_id):
    url, model, _ = two_agents
    body = {
        "model": model_id,
        "prompt": "1, 2, 3, 4,",
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    async with (
        httpx.AsyncClient() as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as r,
    ):
        assert r.headers["x-meshagent-served-by"]
        lines = r.aiter_lines()
        async for line in lines:
            if line.startswith("data: "):
                break
        assert model.runner.stats().active == 1
    with trio.fail_after(10):
        while model.runner.stats().active:
            await trio.sleep(0.02)


async def test_an_unreachable_peer_is_a_503(model_path, nursery, model_id):
    b = ConnectionManager(LocalPeer.create(NodeIdentity.generate(), MESH), TcpTransport())
    await nursery.start(b.run)
    remote = RemoteModel(model_id, "nobody", "whole")
    app_b = OpenAIApp(StaticDirectory(remote=[remote], node=b), InFlight(), lambda: {})
    url, stop = await serve(nursery, app_b)
    async with httpx.AsyncClient() as client:
        r = await client.post(
            f"{url}/v1/chat/completions",
            json={"model": model_id, "messages": [{"role": "user", "content": "hi"}]},
        )
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "peer_unavailable"
    stop.set()
