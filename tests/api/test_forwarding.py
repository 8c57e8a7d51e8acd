"""A request for a model served by another peer is carried there over the overlay."""

from __future__ import annotations

import json
from functools import partial

import httpx
import openai
import pytest
import trio
import trio.testing
from openai import OpenAI

from meshagent.api import access, forwarding, resumable
from meshagent.api.access import Access
from meshagent.api.app import EMBEDDINGS_DEADLINE, OpenAIApp
from meshagent.api.inflight import InFlight
from meshagent.api.server import HttpBinding, serve_http
from meshagent.engine.llama import LlamaEngine
from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret
from meshagent.net.manager import ConnectionManager
from meshagent.net.tcp import TcpTransport
from meshagent.serving.directory import FORWARD_LABEL, GENERATE_LABEL, Headers, RemoteModel
from meshagent.serving.local_model import LocalModel
from meshagent.wire.framing import LengthPrefixDecoder
from meshagent.wire.handshake import LocalPeer
from tests.api.asgi import call

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


# -- what a peer may ask over api/1, and what comes back from one ---------------------------


async def ask_over_api1(
    app, method: str, path: str, body: bytes = b"{}"
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """One request carried to `app` over an `api/1` stream (in memory), as a peer sends it."""
    asker, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(forwarding.serve_forwarded, server, app, peer_id="p33r"))
        await forwarding.send_request(asker, method, path, body)
        frames = LengthPrefixDecoder(forwarding.FRAMING)
        status, headers = await forwarding.read_response_head(asker, frames)
        data = frames.leftover()
        while more := await asker.receive_some():
            data += more
        await asker.aclose()
    return status, headers, data


def control_app(**kw) -> OpenAIApp:
    """An app with every control endpoint wired, and a key (which the overlay never sends)."""
    return OpenAIApp(
        StaticDirectory(),
        InFlight(),
        lambda: {"peer_id": "me", "secret": "status-document-7"},
        peers=lambda: {"peers": ["peer-list-9"]},
        probe=_never_probe,
        access=Access.for_binding(["s3cret"], "127.0.0.1", 9400),
        **kw,
    )


async def _never_probe(body):
    raise AssertionError("a peer made this agent probe")


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/control/status"),
        ("GET", "/control/peers"),
        ("GET", "/control/events"),
        ("POST", "/control/probe"),
        ("GET", "/metrics"),
        ("GET", "/console"),
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("POST", "/v1/responses"),
        ("POST", "/api/chat"),
        ("GET", "/v1/chat/completions"),
        ("POST", "/v1/chat/completions/../../control/status"),
    ],
)
async def test_a_peer_reaches_no_path_but_inference(method, path):
    body = json.dumps({"peer": "someone", "bytes": 1 << 30}).encode()
    with trio.fail_after(10):
        status, _, data = await ask_over_api1(control_app(), method, path, body)
    assert status == 403, data
    error = json.loads(data)["error"]
    assert error["code"] == "peer_not_allowed"
    assert "members of the mesh" in error["message"] and path in error["message"]
    assert b"status-document-7" not in data and b"peer-list-9" not in data


async def test_a_peers_inference_request_goes_through_to_the_endpoint():
    messages = [{"role": "user", "content": "hi"}]
    body = json.dumps({"model": "nope", "messages": messages, "prompt": "hi", "input": "hi"})
    for path in access.PEER_PATHS:
        with trio.fail_after(10):
            status, _, data = await ask_over_api1(control_app(), "POST", path, body.encode())
        assert status == 404 and json.loads(data)["error"]["code"] == "model_not_found", path


async def test_a_real_peer_gets_completions_over_api1_but_not_the_control_plane(
    two_agents, model_id
):
    _, _, a = two_agents
    async with trio.open_nursery() as nursery:
        c = ConnectionManager(LocalPeer.create(NodeIdentity.generate(), MESH), TcpTransport())
        await nursery.start(c.run)
        await c.dial(a.listen_addresses[0], peer_id=a.peer_id)

        async def ask(method: str, path: str, body: dict) -> tuple[int, dict, bytes]:
            stream = await c.open_stream(a.peer_id, FORWARD_LABEL)
            async with stream:
                await forwarding.send_request(stream, method, path, json.dumps(body).encode())
                frames = LengthPrefixDecoder(forwarding.FRAMING)
                status, headers = await forwarding.read_response_head(stream, frames)
                data = frames.leftover()
                while more := await stream.receive_some():
                    data += more
            return status, dict(headers), data

        chat = {"model": model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        with trio.fail_after(60):
            status, headers, data = await ask("POST", "/v1/chat/completions", chat)
            assert status == 200, data
            assert json.loads(data)["choices"][0]["message"]["content"]
            assert headers[b"x-meshagent-stages"] == b"a:0-30"
            status, _, data = await ask("GET", "/control/status", {})
            assert status == 403 and json.loads(data)["error"]["code"] == "peer_not_allowed"
        await c.aclose(grace=0.5)
        nursery.cancel_scope.cancel()


class PipeDirectory(StaticDirectory):
    """Its one remote model's peer is `peer_app`, served over an in-memory `api/1` stream."""

    def __init__(self, nursery: trio.Nursery, peer_app) -> None:
        super().__init__(remote=[RemoteModel("m", "p33r", "whole")])
        self.nursery, self.peer_app = nursery, peer_app

    async def open_stream(self, peer_id: str, label: str = FORWARD_LABEL):
        asker, server = trio.testing.memory_stream_pair()
        serve = partial(forwarding.serve_forwarded, server, self.peer_app, peer_id="asker")
        self.nursery.start_soon(serve)
        return asker


EMBED = {"model": "m", "input": "hello"}


async def test_a_peers_response_headers_are_filtered_before_they_reach_the_client():
    async def peer(scope, receive, send):
        await receive()
        headers = [
            (b"content-type", b"application/json"),
            (b"x-meshagent-stages", b"p33r:0-30"),
            (b"retry-after", b"3"),
            (b"set-cookie", b"session=stolen; Domain=127.0.0.1"),
            (b"x-meshagent-served-by", b"someone-else"),
            (b"content-length", b"999"),
            (b"location", b"http://evil.example/"),
            (b"access-control-allow-origin", b"*"),
            (b"x-other", b"1"),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b'{"data": []}'})

    async with trio.open_nursery() as nursery:
        app = OpenAIApp(PipeDirectory(nursery, peer), InFlight(), lambda: {})
        with trio.fail_after(10):
            r = await call(app, "POST", "/v1/embeddings", body=EMBED)
    assert r.status == 200 and r.json() == {"data": []}
    kept = {"content-type", "x-meshagent-stages", "retry-after", "x-meshagent-served-by"}
    assert r.names() == kept
    assert r.header("x-meshagent-served-by") == "p33r"  # who this agent sent it to
    assert r.header("x-meshagent-stages") == "p33r:0-30"


async def test_a_peer_that_never_answers_an_embeddings_request_is_given_up_on(autojump_clock):
    asked = trio.Event()

    async def peer(scope, receive, send):
        await receive()
        asked.set()
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        app = OpenAIApp(PipeDirectory(nursery, peer), InFlight(), lambda: {})
        with trio.fail_after(EMBEDDINGS_DEADLINE + 60):
            r = await call(app, "POST", "/v1/embeddings", body=EMBED, gone=trio.Event())
        assert trio.current_time() >= EMBEDDINGS_DEADLINE
        nursery.cancel_scope.cancel()
    assert asked.is_set()
    assert r.status == 504, r.body
    error = r.json()["error"]
    assert error["code"] == "peer_timeout" and f"{EMBEDDINGS_DEADLINE:g} s" in error["message"]


async def test_a_client_gone_mid_embeddings_closes_the_peers_stream(autojump_clock):
    asked, heard_gone, gone = trio.Event(), trio.Event(), trio.Event()

    async def peer(scope, receive, send):
        await receive()
        asked.set()
        if (await receive())["type"] == "http.disconnect":
            heard_gone.set()

    async with trio.open_nursery() as nursery:
        app = OpenAIApp(PipeDirectory(nursery, peer), InFlight(), lambda: {})

        async def client_leaves():
            await asked.wait()
            gone.set()

        nursery.start_soon(client_leaves)
        with trio.fail_after(5):
            await call(app, "POST", "/v1/embeddings", body=EMBED, gone=gone)
            await heard_gone.wait()
        nursery.cancel_scope.cancel()
