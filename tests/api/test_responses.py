"""`/v1/responses` on the fake model, in process: the text and usage of the chat completion it
becomes, the Responses event sequence, conversations remembered, errors in the shape of
OpenAI's, a request carried to the agent that serves the model, and a stream cut by the
shutdown ending in `response.failed`."""

from __future__ import annotations

import json

import pytest
import trio

from meshagent.api.app import OpenAIApp
from meshagent.api.inflight import InFlight
from tests.api.asgi import Answer, call, call_and
from tests.api.test_forwarding import PipeDirectory, StaticDirectory


def events(answer: Answer) -> list[dict]:
    return [json.loads(b[6:]) for b in answer.body.split(b"\n\n") if b.startswith(b"data: ")]


ASK = {"model": "fake", "input": "hello", "max_output_tokens": 12, "temperature": 0}


async def chat_text(app, **extra) -> tuple[str, dict]:
    messages = [{"role": "user", "content": "hello"}]
    body = {"model": "fake", "messages": messages, "max_tokens": 12, "temperature": 0, **extra}
    r = await call(app, "POST", "/v1/chat/completions", body=body)
    assert r.status == 200, r.body
    return r.json()["choices"][0]["message"]["content"], r.json()["usage"]


async def test_a_response_is_the_chat_completion_it_asks_for(fake_app):
    text, usage = await chat_text(fake_app)
    r = await call(fake_app, "POST", "/v1/responses", body=ASK)
    assert r.status == 200, r.body
    body = r.json()
    assert body["object"] == "response" and body["id"].startswith("resp_")
    [message] = body["output"]
    assert message["content"][0]["text"] == text
    assert body["status"] == "incomplete"  # 12 tokens: cut by the limit
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["input_tokens"] == usage["prompt_tokens"]
    assert body["usage"]["output_tokens"] == usage["completion_tokens"] == 12
    assert body["usage"]["total_tokens"] == usage["total_tokens"]


async def test_a_streamed_response_is_the_responses_event_sequence(fake_app):
    text, _ = await chat_text(fake_app)
    r = await call(fake_app, "POST", "/v1/responses", body={**ASK, "stream": True})
    assert r.status == 200 and r.header("content-type") == "text/event-stream"
    got = events(r)
    kinds = [e["type"] for e in got]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    deltas = [e["delta"] for e in got if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == text and all(deltas)
    assert got[-1]["response"]["output"][0]["content"][0]["text"] == text


async def test_a_response_goes_on_from_the_one_before(fake_app):
    first = (await call(fake_app, "POST", "/v1/responses", body=ASK)).json()
    r = await call(
        fake_app, "POST", "/v1/responses", body={**ASK, "previous_response_id": first["id"]}
    )
    assert r.status == 200
    assert r.json()["usage"]["input_tokens"] > first["usage"]["input_tokens"] + 12
    r = await call(
        fake_app, "POST", "/v1/responses", body={**ASK, "previous_response_id": "resp_x"}
    )
    assert r.status == 400 and r.json()["error"]["code"] == "previous_response_not_found"


@pytest.mark.parametrize("stream", [False, True])
async def test_errors_before_any_text_keep_their_status_and_shape(fake_app, stream):
    for body, status, code in (
        ({**ASK, "model": "nope"}, 404, "model_not_found"),
        ({**ASK, "max_output_tokens": 100_000}, 400, "context_length_exceeded"),
        ({**ASK, "reasoning": {"effort": "high"}}, 400, "unsupported_parameter"),
    ):
        r = await call(fake_app, "POST", "/v1/responses", body={**body, "stream": stream})
        assert r.status == status, r.body
        assert r.json()["error"]["code"] == code


async def test_a_response_from_the_agent_that_serves_the_model(fake_app):
    own = (await call(fake_app, "POST", "/v1/responses", body=ASK)).json()
    async with trio.open_nursery() as nursery:
        asker = OpenAIApp(PipeDirectory(nursery, fake_app, "fake"), InFlight(), lambda: {})
        r = await call(asker, "POST", "/v1/responses", body=ASK)
        nursery.cancel_scope.cancel()
    assert r.status == 200, r.body
    assert r.json()["output"][0]["content"] == own["output"][0]["content"]
    assert r.json()["usage"] == own["usage"]


async def test_a_stream_cut_by_the_shutdown_ends_in_response_failed(fake_model):
    inflight = InFlight()
    app = OpenAIApp(StaticDirectory([fake_model]), inflight, lambda: {})
    body = {**ASK, "max_output_tokens": 200, "stream": True}
    # 0.1 s in, it streams (200 tokens take longer)
    answer = await call_and(app, "POST", "/v1/responses", inflight.expire_now, after=0.1, body=body)
    got = events(answer)
    assert answer.status == 200
    assert [e["type"] for e in got[-2:]] == ["error", "response.failed"]
    assert got[-2]["code"] == "shutting_down"
    assert got[-1]["response"]["error"]["code"] == "shutting_down"
