"""A request for a model served by another peer is carried there over the overlay (`gen/1`):
completions and embeddings, and nothing else a member may ask."""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from functools import partial

import httpx
import openai
import pytest
import trio
import trio.testing
from openai import OpenAI

from meshagent.api import entry
from meshagent.api import gen_messages as gm
from meshagent.api.access import Access
from meshagent.api.app import OpenAIApp
from meshagent.api.elsewhere import EMBEDDINGS_DEADLINE
from meshagent.api.gen_stream import frames, read_message
from meshagent.api.inflight import InFlight
from meshagent.api.server import HttpBinding, serve_http
from meshagent.engine.llama import LlamaEngine
from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret
from meshagent.net.manager import ConnectionManager
from meshagent.net.tcp import TcpTransport
from meshagent.serving.directory import GENERATE_LABEL, Headers, RemoteModel
from meshagent.serving.generation import Delta, Finished
from meshagent.serving.local_model import LocalModel
from meshagent.testing.fake_engine import FakeEngine
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

    async def changed(self) -> None:
        await trio.sleep(0.01)  # a test changes its answers at any time: look again soon

    async def open_stream(self, peer_id: str, label: str = GENERATE_LABEL):
        assert self.node is not None
        return await self.node.open_stream(peer_id, label)


async def route_api(stream, app: OpenAIApp) -> None:
    """Route an inbound stream as an agent does: `gen/1` to the API's entry, the rest reset."""
    if stream.label != GENERATE_LABEL:
        stream.reset(f"no service for stream label {stream.label!r}")
    else:
        await entry.serve(stream, app.catalog, peer_id=stream.peer_id)


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


# -- what a member may ask over gen/1, and what comes back from one -------------------------


async def ask_over_gen(app, path: str, body: bytes = b"{}") -> list[gm.Message]:
    """One ask carried to `app` over a `gen/1` stream (in memory), as a member sends it: the
    messages of its answer."""
    asker, server = trio.testing.memory_stream_pair()
    got: list[gm.Message] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(entry.serve, server, app.catalog, peer_id="p33r"))
        await asker.send_all(gm.encode(gm.Ask("POST", path, body)))
        reader = frames()
        while not got or not isinstance(got[-1], gm.Fail | Finished | gm.Embedded):
            got.append(await read_message(asker, reader))
        await asker.aclose()
    return got


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
    "path",
    [
        "/control/status",
        "/control/peers",
        "/control/events",
        "/control/probe",
        "/metrics",
        "/console",
        "/v1/models",
        "/health",
        "/v1/responses",
        "/api/chat",
        "/v1/chat/completions/../../control/status",
    ],
)
async def test_a_member_reaches_no_path_but_inference(path):
    body = json.dumps({"peer": "someone", "bytes": 1 << 30}).encode()
    with trio.fail_after(10):
        [fail] = await ask_over_gen(control_app(), path, body)
    assert isinstance(fail, gm.Fail) and not fail.resumable
    assert fail.error.status == 404 and fail.error.code == "unknown_url"
    assert path in fail.error.message
    assert "status-document-7" not in fail.error.message


async def test_a_members_inference_ask_reaches_the_model_it_names():
    messages = [{"role": "user", "content": "hi"}]
    body = json.dumps({"model": "nope", "messages": messages, "prompt": "hi", "input": "hi"})
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        with trio.fail_after(10):
            [fail] = await ask_over_gen(control_app(), path, body.encode())
        # This agent does not serve that model: another may, so the asker may go on.
        assert isinstance(fail, gm.Fail) and fail.resumable, path
        assert fail.error.status == 503, path


async def test_a_real_member_gets_completions_over_gen1_but_not_the_control_plane(
    two_agents, model_id
):
    _, _, a = two_agents
    async with trio.open_nursery() as nursery:
        c = ConnectionManager(LocalPeer.create(NodeIdentity.generate(), MESH), TcpTransport())
        await nursery.start(c.run)
        await c.dial(a.listen_addresses[0], peer_id=a.peer_id)

        async def ask(path: str, body: dict) -> list[gm.Message]:
            stream = await c.open_stream(a.peer_id, GENERATE_LABEL)
            got: list[gm.Message] = []
            async with stream:
                await stream.send_all(gm.encode(gm.Ask("POST", path, json.dumps(body).encode())))
                reader = frames()
                while not got or not isinstance(got[-1], gm.Fail | Finished):
                    got.append(await read_message(stream, reader))
            return got

        chat = {"model": model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        with trio.fail_after(60):
            head, *deltas, done = await ask("/v1/chat/completions", chat)
            assert isinstance(head, gm.Head) and isinstance(done, Finished)
            assert "".join(d.text for d in deltas if isinstance(d, Delta))
            assert dict(head.headers)[b"x-meshagent-stages"] == b"a:0-30"
            [fail] = await ask("/control/status", {})
            assert isinstance(fail, gm.Fail) and fail.error.code == "unknown_url"
        await c.aclose(grace=0.5)
        nursery.cancel_scope.cancel()


# -- embeddings carried to the peer that serves the model -----------------------------------


class FakeEmbedder:
    """Vectors from the texts' lengths, float64 values a float32 would not hold."""

    async def embed(self, texts):
        vectors = [[len(t) / 3, -1 / 7, 1e-300] for t in texts]
        return vectors, sum(len(t) for t in texts)


class PipeDirectory(StaticDirectory):
    """Its one remote model's peer is `peer`, reached over an in-memory `gen/1` stream: an
    agent's entry (an `OpenAIApp`) or a function given the stream."""

    def __init__(self, nursery: trio.Nursery, peer, model: str = "m") -> None:
        super().__init__(remote=[RemoteModel(model, "p33r", "whole")])
        self.nursery, self.peer = nursery, peer

    async def open_stream(self, peer_id: str, label: str = GENERATE_LABEL):
        asker, server = trio.testing.memory_stream_pair()
        if isinstance(self.peer, OpenAIApp):
            self.nursery.start_soon(partial(entry.serve, server, self.peer.catalog, peer_id="a"))
        else:
            self.nursery.start_soon(self.peer, server)
        return asker


EMBED = {"model": "m", "input": "hello"}


@pytest.fixture
async def embedding_entry(nursery):
    """An agent serving the fake model as `m`, with an embedder."""
    model = LocalModel.whole(FakeEngine(), max_queue=4)
    model.info = replace(model.info, id="m")
    model.embedder = FakeEmbedder()
    return OpenAIApp(StaticDirectory([model]), InFlight(), lambda: {})


async def test_embeddings_from_a_peer_are_what_it_answers_itself(embedding_entry):
    body = {"model": "m", "input": ["hello", "a longer text"], "encoding_format": "float"}
    own = await call(embedding_entry, "POST", "/v1/embeddings", body=body)
    assert own.status == 200, own.body
    async with trio.open_nursery() as nursery:
        app = OpenAIApp(PipeDirectory(nursery, embedding_entry), InFlight(), lambda: {})
        for fmt in ("float", "base64"):
            asked = {**body, "encoding_format": fmt}
            r = await call(app, "POST", "/v1/embeddings", body=asked)
            mine = await call(embedding_entry, "POST", "/v1/embeddings", body=asked)
            assert r.status == 200 and r.body == mine.body, r.body
            assert r.header("x-meshagent-served-by") == "p33r"
            assert r.names() == {"content-type", "x-meshagent-served-by"}
        nursery.cancel_scope.cancel()


async def test_an_embeddings_error_at_the_peer_comes_back_as_it_is(embedding_entry):
    split = embedding_entry.catalog.local("m")
    split.embedder = None  # a split cannot embed
    async with trio.open_nursery() as nursery:
        app = OpenAIApp(PipeDirectory(nursery, embedding_entry), InFlight(), lambda: {})
        r = await call(app, "POST", "/v1/embeddings", body=EMBED)
        own = await call(embedding_entry, "POST", "/v1/embeddings", body=EMBED)
        nursery.cancel_scope.cancel()
    assert r.status == 400 and r.json() == own.json()
    assert r.json()["error"]["code"] == "model_split"


@pytest.mark.parametrize(
    "answer,why",
    [
        ([gm.Vector((1.0,)), gm.Vector((1.0,)), gm.Embedded("m", 1)], "unexpected Vector"),
        ([gm.Embedded("m", 1)], "unexpected Embedded after 0"),
        ([gm.Head([], "m", None, 1)], "unexpected Head"),
        ([], "ended the stream"),
    ],
    ids=["too-many", "too-few", "not-vectors", "nothing"],
)
async def test_a_peer_that_answers_embeddings_wrongly_is_a_502(answer, why):
    async def peer(stream):
        await read_message(stream, frames())
        for msg in answer:
            await stream.send_all(gm.encode(msg))
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        app = OpenAIApp(PipeDirectory(nursery, peer), InFlight(), lambda: {})
        with trio.fail_after(10):
            r = await call(app, "POST", "/v1/embeddings", body=EMBED)
        nursery.cancel_scope.cancel()
    assert r.status == 502, r.body
    assert r.json()["error"]["code"] == "peer_failed" and why in r.json()["error"]["message"]


async def test_a_peer_that_never_answers_an_embeddings_request_is_given_up_on(autojump_clock):
    asked = trio.Event()

    async def peer(stream):
        await read_message(stream, frames())
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

    async def peer(stream):
        await read_message(stream, frames())
        asked.set()
        with contextlib.suppress(trio.BrokenResourceError):
            while await stream.receive_some():
                pass
        heard_gone.set()

    async with trio.open_nursery() as nursery:
        app = OpenAIApp(PipeDirectory(nursery, peer), InFlight(), lambda: {})

        async def client_leaves():
            await asked.wait()
            gone.set()

        nursery.start_soon(client_leaves)
        with trio.fail_after(5):
            r = await call(app, "POST", "/v1/embeddings", body=EMBED, gone=gone)
            await heard_gone.wait()
        nursery.cancel_scope.cancel()
    assert r.status == 0  # nothing was sent to a client that left
