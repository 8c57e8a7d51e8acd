"""A completion carried to another agent survives losing that agent: over real overlay
connections on loopback, with fake models, the agent holding the client continues the request
on the next entry (or on itself) with the tokens the client has, and the client gets the text
of an undisturbed run, once, ending in [DONE]; each of n choices goes on by itself; a
continuation outside the vocabulary is refused on either side; and neither side waits for a
stream's first message for ever."""

from __future__ import annotations

import json

import cbor2
import httpx
import pytest
import structlog
import trio

from meshagent.api import carried, entry
from meshagent.api import gen_messages as gm
from meshagent.api.app import OpenAIApp
from meshagent.api.errors import ApiError
from meshagent.api.gen_messages import FRAMING, Fail
from meshagent.api.gen_stream import frames, read_message
from meshagent.api.inflight import InFlight
from meshagent.errors import ModelMoved
from meshagent.identity.keys import NodeIdentity
from meshagent.net.config import OverlayConfig
from meshagent.net.manager import ConnectionManager
from meshagent.net.tcp import TcpTransport
from meshagent.serving import sampling as sampling_module
from meshagent.serving.directory import GENERATE_LABEL, RemoteModel
from meshagent.serving.generation import Delta, Finished
from meshagent.serving.local_model import LocalModel
from meshagent.testing.fake_engine import FakeEngine
from meshagent.wire.handshake import LocalPeer
from tests.api.test_forwarding import MESH, StaticDirectory, route_api, serve

PROMPT = "tell me a story"
TOKENS = 120

# ----- a mesh on loopback -----


class Entry:
    """An agent serving the fake model whole, reached over the overlay."""

    def __init__(self, nursery, *, delay=0.002):
        self.model = LocalModel.whole(FakeEngine(slots=2, delay=delay), max_queue=4)
        self.node = ConnectionManager(
            LocalPeer.create(NodeIdentity.generate(), MESH),
            TcpTransport(),
            listen=["127.0.0.1:0"],
            on_stream=lambda s: route_api(s, self.app),
        )
        self.directory = Moving(self.node)
        self.directory.local = [self.model]
        self.app = OpenAIApp(self.directory, InFlight(), lambda: {})
        self.scope = trio.CancelScope()
        self.nursery = nursery

    async def start(self):
        async def run(task_status=trio.TASK_STATUS_IGNORED):
            with self.scope:
                async with trio.open_nursery() as n:
                    await n.start(self.model.run)
                    await n.start(self.app.catalog.rejoins.run)
                    await n.start(self.node.run)
                    task_status.started()

        await self.nursery.start(run)
        return self

    def kill(self):
        self.scope.cancel()  # its connections end and the requests it was serving with them


class Moving(StaticDirectory):
    """The asker's view of where the model runs, which the test changes."""

    def __init__(self, node, deadline=5.0):
        super().__init__(node=node)
        self.deadline = deadline

    def unserved_for_now(self, name):
        return self.deadline

    def why_unserved(self, name):
        return None

    def serve_from(self, to: Entry | None):
        peer = None if to is None else to.node.peer_id
        self.remote = [] if peer is None else [RemoteModel("fake", peer, "whole", layers=3)]


@pytest.fixture
async def mesh(nursery):
    entries = [await Entry(nursery).start() for _ in range(2)]
    asker = ConnectionManager(LocalPeer.create(NodeIdentity.generate(), MESH), TcpTransport())
    await nursery.start(asker.run)
    for e in entries:
        await asker.dial(e.node.listen_addresses[0], peer_id=e.node.peer_id)
    directory = Moving(asker)
    directory.serve_from(entries[0])
    app = OpenAIApp(directory, InFlight(), lambda: {})
    url, _ = await serve(nursery, app)
    return url, entries, directory, app


async def stream_text(url, sampling, on_chunk=None) -> tuple[str, dict, list[str]]:
    body = {
        "model": "fake",
        "prompt": PROMPT,
        "max_tokens": TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        **sampling,
    }
    text, usage, events = "", {}, []
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200, await r.aread()
        served_by = r.headers.get("x-meshagent-served-by")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                continue
            usage = chunk.get("usage") or usage
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
                if on_chunk is not None:
                    await on_chunk(len(events))
    usage["served_by"] = served_by
    return text, usage, events


SAMPLINGS = [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "seed": 4}]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
async def test_a_request_continues_on_the_next_entry_when_its_entry_is_lost(mesh, sampling):
    url, (first, second), directory, _ = mesh
    undisturbed, usage, _ = await stream_text(url, sampling)
    assert usage["completion_tokens"] == TOKENS and "replays" not in usage.get("meshagent", {})

    async def lose_entry(n):
        if n == 30:
            first.kill()
            directory.serve_from(second)

    text, usage, events = await stream_text(url, sampling, lose_entry)
    assert text == undisturbed and events[-1] == "[DONE]"
    assert usage["completion_tokens"] == TOKENS
    [replay] = usage["meshagent"]["replays"]
    assert "was lost" in replay["reason"] and replay["tokens"] >= 29
    assert replay["lost"] == [f"{first.node.peer_id}:0-3"]
    assert 0 <= replay["wait_ms"] <= replay["ms"]


async def test_an_unseeded_request_goes_on_with_the_seed_its_first_entry_drew(mesh, monkeypatch):
    url, (first, second), directory, _ = mesh
    draws = iter(range(1000, 1100))  # the seeds entries draw for unseeded requests, in turn
    monkeypatch.setattr(sampling_module.secrets, "randbits", lambda _: next(draws))
    warm = {"temperature": 0.7, "top_p": 0.9}

    async def lose_entry(n):
        if n == 30:
            first.kill()
            directory.serve_from(second)

    text, usage, _ = await stream_text(url, warm, lose_entry)  # the first entry drew 1000
    assert len(usage["meshagent"]["replays"]) == 1
    assert text == (await stream_text(url, {**warm, "seed": 1000}))[0]
    assert next(draws) == 1001  # the second entry drew none


async def test_the_asker_goes_on_itself_when_the_mesh_moved_the_model_to_it(mesh):
    url, (first, _), directory, _ = mesh
    undisturbed, _, _ = await stream_text(url, {"temperature": 0})
    here = LocalModel.whole(FakeEngine(slots=2), max_queue=4)
    async with trio.open_nursery() as n:
        await n.start(here.run)

        async def moved_here(count):
            if count == 30:
                first.kill()
                directory.serve_from(None)
                directory.local = [here]

        text, usage, _ = await stream_text(url, {"temperature": 0}, moved_here)
        n.cancel_scope.cancel()
    assert text == undisturbed
    assert len(usage["meshagent"]["replays"]) == 1
    assert here.runner.stats().tokens_processed > 0


async def test_an_entry_that_lets_go_of_the_request_hands_it_on(mesh):
    url, (first, second), directory, _ = mesh
    undisturbed, _, _ = await stream_text(url, {"temperature": 0})

    async def moved(n):
        if n == 20:  # the mesh moves the model away from the entry, which stays up
            directory.serve_from(second)
            first.model.runner.abort(ModelMoved("the mesh moved this model"))

    text, usage, _ = await stream_text(url, {"temperature": 0}, moved)
    assert text == undisturbed
    [replay] = usage["meshagent"]["replays"]
    assert "let go" in replay["reason"] and replay["lost"] == []
    assert usage["served_by"] == first.node.peer_id  # the headers went out before the move


@pytest.mark.parametrize("warm", [False, True], ids=["greedy", "unseeded"])
async def test_a_request_on_the_entry_itself_goes_on_where_the_mesh_moved_the_model(
    mesh, monkeypatch, warm
):
    _, (first, second), _, _ = mesh
    draws = iter(range(1000, 1100))
    monkeypatch.setattr(sampling_module.secrets, "randbits", lambda _: next(draws))
    sampling = {"temperature": 0.8, "top_p": 0.9} if warm else {"temperature": 0}
    await first.node.dial(second.node.listen_addresses[0], peer_id=second.node.peer_id)
    async with trio.open_nursery() as n:
        url, stop = await serve(n, first.app)

        async def moved(count):
            if count == 25:
                first.directory.local = []
                first.directory.serve_from(second)
                first.model.runner.abort(ModelMoved("the mesh moved this model"))

        text, usage, events = await stream_text(url, sampling, moved)  # draws 1000 if warm
        assert events[-1] == "[DONE]"
        [replay] = usage["meshagent"]["replays"]
        assert "moved" in replay["reason"] and replay["lost"] == []
        assert second.model.runner.stats().tokens_processed > replay["tokens"]
        # The same text as an undisturbed run on the new entry with the seed drawn first.
        assert text == (await stream_text(url, {**sampling, "seed": 1000}))[0]
        stop.set()


async def test_with_no_entry_to_continue_on_the_stream_ends_with_an_error_event(mesh):
    url, (first, _), directory, _ = mesh
    directory.deadline = 1.0

    async def lost(n):
        if n == 10:
            first.kill()
            directory.serve_from(None)

    with trio.fail_after(10):
        text, _, events = await stream_text(url, {"temperature": 0}, lost)
    assert text and events[-1] != "[DONE]"
    error = json.loads(events[-1])["error"]
    assert error["code"] == "split_unavailable" and "within 1 s" in error["message"]


# ----- n completions: a stream each -----

N_SEEDED = {"n": 3, "temperature": 1.0, "seed": 4}


async def choice_texts(url, sampling, on_chunk=None, *, stream=True) -> tuple[dict, dict]:
    """Each choice's text of a completion of `PROMPT`, and the usage."""
    body = {"model": "fake", "prompt": PROMPT, "max_tokens": TOKENS, "stream": stream, **sampling}
    body["stream_options"] = {"include_usage": True} if stream else None
    texts: dict[int, str] = {}
    async with httpx.AsyncClient(timeout=30) as client:
        if not stream:
            r = await client.post(f"{url}/v1/completions", json=body)
            assert r.status_code == 200, r.text
            whole = r.json()
            return {c["index"]: c["text"] for c in whole["choices"]}, whole["usage"]
        usage, count = {}, 0
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                usage = chunk.get("usage") or usage
                for c in chunk["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                count += 1
                if on_chunk is not None:
                    await on_chunk(count)
    return texts, usage


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_n_completions_carried_to_an_entry_are_the_ones_it_gives_itself(
    mesh, nursery, stream
):
    url, (first, _), _, _ = mesh
    own_url, _ = await serve(nursery, first.app)
    texts, usage = await choice_texts(url, N_SEEDED, stream=stream)
    own, own_usage = await choice_texts(own_url, N_SEEDED, stream=stream)
    assert texts == own and len(set(texts.values())) == 3
    assert usage["completion_tokens"] == own_usage["completion_tokens"] == 3 * TOKENS
    assert usage["prompt_tokens"] == own_usage["prompt_tokens"]


async def test_unseeded_n_completions_sample_with_the_seed_the_asker_drew(
    mesh, nursery, monkeypatch
):
    url, (first, _), _, _ = mesh
    own_url, _ = await serve(nursery, first.app)
    draws = iter(range(1000, 1100))
    monkeypatch.setattr(sampling_module.secrets, "randbits", lambda _: next(draws))
    warm = {"n": 2, "temperature": 1.0}
    texts, _ = await choice_texts(url, warm)  # the asker draws 1000; the entry none
    assert next(draws) == 1001
    assert texts == (await choice_texts(own_url, {**warm, "seed": 1000}))[0]


async def test_each_of_n_completions_goes_on_when_their_entry_is_lost(mesh):
    url, (first, second), directory, _ = mesh
    undisturbed, _ = await choice_texts(url, N_SEEDED)

    async def lose_entry(count):
        if count == 40:
            first.kill()
            directory.serve_from(second)

    texts, usage = await choice_texts(url, N_SEEDED, lose_entry)
    assert texts == undisturbed
    assert usage["completion_tokens"] == 3 * TOKENS
    [replay] = usage["meshagent"]["replays"]  # choice 0's; each went on by itself
    assert replay["lost"] == [f"{first.node.peer_id}:0-3"]
    assert second.model.runner.stats().tokens_processed > 0


async def test_a_bad_request_is_refused_by_the_entry_with_its_own_error(mesh):
    url, *_ = mesh
    async with httpx.AsyncClient() as client:
        r = await client.post(
            f"{url}/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 10**6}
        )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


# ----- what a member may not send, and the first message's deadlines -----


def _raw_ask(history: list[int], delivered: int = 0) -> bytes:
    """An ask for 8 tokens as any member could frame it, whatever its values."""
    body = json.dumps({"model": "fake", "prompt": PROMPT, "max_tokens": 8}).encode()
    ask = {0: 1, 1: "ask", 2: "POST", 3: "/v1/completions", 4: body, 5: history}
    ask.update({6: delivered, 7: None})
    return FRAMING.encode(cbor2.dumps(ask))


async def _first_reply(directory, to: Entry, payload: bytes):
    stream = await directory.open_stream(to.node.peer_id, GENERATE_LABEL)
    try:
        await stream.send_all(payload)
        with trio.fail_after(5):
            return await read_message(stream, frames())
    finally:
        await stream.aclose()


@pytest.mark.parametrize(
    "ask,code,why",
    [
        (_raw_ask([5, -1]), "invalid_gen_message", "outside"),
        (_raw_ask([2**31]), "invalid_gen_message", "outside"),
        (_raw_ask([5, 40]), "invalid_continuation", "outside"),  # the fake's vocabulary: 0-39
        (_raw_ask([5] * 9), "invalid_continuation", "more than"),  # the ask is for 8 tokens
        (_raw_ask([5, 6], 10**6), "invalid_continuation", "more characters"),
    ],
    ids=["negative", "2**31", "vocabulary-size", "too-long", "delivered-past-its-text"],
)
async def test_a_continuation_the_model_cannot_have_generated_is_refused_and_the_entry_serves_on(
    mesh, ask, code, why
):
    url, (first, _), directory, _ = mesh
    reply = await _first_reply(directory, first, ask)
    assert isinstance(reply, Fail) and not reply.resumable, reply
    assert reply.error.status == 400 and reply.error.code == code
    assert why in reply.error.message
    text, usage, events = await stream_text(url, {"temperature": 0})
    assert text and events[-1] == "[DONE]" and usage["completion_tokens"] == TOKENS


async def test_an_entry_waits_for_an_ask_only_so_long(mesh, monkeypatch):
    _, (first, _), directory, _ = mesh
    monkeypatch.setattr(entry, "ASK_DEADLINE", 0.2)
    reply = await _first_reply(directory, first, b"")
    assert isinstance(reply, Fail) and reply.error.code == "invalid_gen_message"
    assert "no ask within 0.2 s" in reply.error.message


async def _member(nursery, directory, on_stream) -> RemoteModel:
    """A member answering `gen/1` with `on_stream`, connected, and the only one the
    directory says serves the model."""
    node = ConnectionManager(
        LocalPeer.create(NodeIdentity.generate(), MESH),
        TcpTransport(),
        listen=["127.0.0.1:0"],
        on_stream=on_stream,
    )
    await nursery.start(node.run)
    await directory.node.dial(node.listen_addresses[0], peer_id=node.peer_id)
    remote = RemoteModel("fake", node.peer_id, "whole", layers=3)
    directory.remote = [remote]
    return remote


async def test_an_asker_waits_for_a_head_only_so_long(mesh, nursery, monkeypatch):
    _, _, directory, _ = mesh
    held = []  # a member that takes gen/1 streams and never answers

    async def hold(stream):
        held.append(stream)
        await trio.sleep_forever()

    remote = await _member(nursery, directory, hold)
    monkeypatch.setattr(carried, "HEAD_DEADLINE", 0.2)
    ask = gm.Ask("POST", "/v1/completions", b"{}")
    one = carried.Carried(directory, ask, "fake", 1.0, lambda: None)
    with trio.fail_after(5), pytest.raises(ApiError) as refused:
        await one.start(remote)
    await one.aclose()
    assert refused.value.status == 503 and "no head within 0.2 s" in refused.value.message
    assert held


async def test_tokens_an_entry_cannot_have_generated_are_refused_where_the_asker_goes_on(mesh):
    _, (first, _), directory, _ = mesh
    body = json.dumps({"model": "fake", "prompt": PROMPT, "max_tokens": 8}).encode()
    prepared = entry.prepare_carried(first.app.catalog, "/v1/completions", body)
    ask = gm.Ask("POST", "/v1/completions", body)
    # The deltas of a lost entry held a token outside the vocabulary; the model is here now.
    one = carried.Carried(directory, ask, "fake", 1.0, lambda: prepared, history=[3, 40])
    send, _ = trio.open_memory_channel(100)
    with trio.fail_after(5), pytest.raises(ApiError) as refused:
        await one.hand_on("the mesh moved the model", send.send_nowait)
    assert refused.value.status == 502 and refused.value.code == "bad_continuation"
    assert "token id 40" in refused.value.message


async def test_an_entrys_receipt_reaches_the_client_filtered_and_named_by_the_asker(mesh, nursery):
    """An entry's head may carry any `x-meshagent-*` name; the client gets the receipt's
    headers only, and `x-meshagent-served-by` once: the peer this agent carried it to."""
    url, _, directory, _ = mesh

    async def forge(stream):
        await read_message(stream, frames())
        forged = [
            (b"x-meshagent-served-by", b"someone-else"),
            (b"x-meshagent-stages", b"p:0-30"),
            (b"x-meshagent-session", b"cookie-ish"),
        ]
        for msg in (
            gm.Head(forged, "fake", None, 3),
            Delta("hello", (5,)),
            Finished("stop", 3, 1),
        ):
            await stream.send_all(gm.encode(msg))
        await trio.sleep(1)

    forger = await _member(nursery, directory, forge)
    body = {"model": "fake", "prompt": PROMPT, "max_tokens": 4}
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.headers.get_list("x-meshagent-served-by") == [forger.peer_id]
    assert r.headers["x-meshagent-stages"] == "p:0-30"
    assert "x-meshagent-session" not in r.headers


async def test_an_ask_whose_body_holds_a_number_past_what_python_reads_is_refused(mesh):
    """A JSON integer of over 4300 digits is refused by Python's parser with a ValueError
    of its own: the entry answers 400 and serves on."""
    url, (first, _), directory, _ = mesh
    body = b'{"model": "fake", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"
    ask = {0: 1, 1: "ask", 2: "POST", 3: "/v1/completions", 4: body, 5: [], 6: 0, 7: None}
    reply = await _first_reply(directory, first, FRAMING.encode(cbor2.dumps(ask)))
    assert isinstance(reply, Fail) and not reply.resumable, reply
    assert reply.error.status == 400 and "JSON" in reply.error.message
    async with httpx.AsyncClient() as client:
        answer = await client.post(
            f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}
        )
    assert answer.status_code == 400 and "JSON" in answer.json()["error"]["message"]
    text, usage, events = await stream_text(url, {"temperature": 0})
    assert text and events[-1] == "[DONE]" and usage["completion_tokens"] == TOKENS


# ----- a completion follows its asker's connection -----


async def test_a_completion_moves_with_its_connection_instead_of_replaying(nursery):
    """The asker's connection to the entry is replaced mid-stream (a second one between the
    two wins, as a punched path replaces a relayed one): the asker rejoins the completion on
    the new connection and the entry goes on there. The same text, nothing replayed, and the
    old connection closes long before the stream ends (its drain grace outlasts the stream:
    a completion that stayed would have kept it open)."""
    slow = await Entry(nursery, delay=0.02).start()
    asker = ConnectionManager(
        LocalPeer.create(NodeIdentity.generate(), MESH),
        TcpTransport(),
        config=OverlayConfig(drain_grace=60.0),
    )
    await nursery.start(asker.run)
    address = slow.node.listen_addresses[0]
    await asker.dial(address, peer_id=slow.node.peer_id)
    directory = Moving(asker)
    directory.serve_from(slow)
    url, _ = await serve(nursery, OpenAIApp(directory, InFlight(), lambda: {}))
    undisturbed, _, _ = await stream_text(url, {"temperature": 0})
    old = asker.connection(slow.node.peer_id)
    closed_at: list[float] = []

    async def replace_at(n):
        if n == 20:
            await asker.dial(address, peer_id=slow.node.peer_id, replace=True)
            assert asker.connection(slow.node.peer_id) is not old

            async def watch():
                await old.wait_closed()
                closed_at.append(trio.current_time())

            nursery.start_soon(watch)

    with structlog.testing.capture_logs() as logs:
        text, usage, events = await stream_text(url, {"temperature": 0}, replace_at)
    ended = trio.current_time()
    assert text == undisturbed and events[-1] == "[DONE]"
    assert "replays" not in usage.get("meshagent", {})
    assert [e for e in logs if e["event"] == "gen.stream_moved"]
    assert closed_at and closed_at[0] < ended - 0.5  # well before the last of ~100 tokens


async def test_a_rejoin_of_no_completion_here_is_refused_and_the_entry_serves_on(mesh):
    # Another peer's ticket, or none: a `Fail`, and nothing else changes.
    url, (first, _), directory, _ = mesh
    reply = await _first_reply(directory, first, gm.encode(gm.Rejoin(12345)))
    assert isinstance(reply, Fail) and not reply.resumable
    assert reply.error.code == "unknown_ticket"
    text, _, events = await stream_text(url, {"temperature": 0})
    assert text and events[-1] == "[DONE]"


async def test_a_move_the_asker_did_not_ask_for_is_a_broken_stream(mesh, nursery):
    # A member that answers an ask, then says the completion moved, where no rejoin was
    # sent: the asker treats the stream as broken and goes on where it can (here: nowhere,
    # so the request fails, naming why).
    url, _, directory, _ = mesh
    directory.deadline = 1.0

    async def lie(stream):
        await read_message(stream, frames())  # the ask
        await stream.send_all(gm.encode(gm.Head([], "fake", None, 4)))
        await stream.send_all(gm.encode(gm.Moved()))
        await trio.sleep_forever()

    await _member(nursery, directory, lie)
    body = {"model": "fake", "prompt": PROMPT, "max_tokens": TOKENS, "stream": True}
    with trio.fail_after(10):
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(f"{url}/v1/completions", json=body)
    # (nothing was streamed yet: the error is the answer's status)
    assert r.status_code == 503, r.text
    assert "moved the stream, and it was not asked to" in r.json()["error"]["message"]
