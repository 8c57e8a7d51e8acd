"""Ollama's endpoints on the fake model, in process: the text of the completion each becomes,
newline-delimited streams ending in a `done` line with the counts, errors as `{"error": ...}`
with their status, and a stream cut by the shutdown ending in an error line."""

from __future__ import annotations

import json

import pytest

from meshagent.api.app import OpenAIApp
from meshagent.api.inflight import InFlight
from tests.api.asgi import Answer, call, call_and
from tests.api.test_forwarding import StaticDirectory

OPTIONS = {"temperature": 0, "num_predict": 10}


def lines(answer: Answer) -> list[dict]:
    return [json.loads(line) for line in answer.body.splitlines()]


async def completion(app, path: str, body: dict) -> dict:
    r = await call(app, "POST", path, body={"model": "fake", "max_tokens": 10, **body})
    assert r.status == 200, r.body
    return r.json()


async def test_generate_is_the_text_completion_of_a_raw_prompt(fake_app):
    want = await completion(fake_app, "/v1/completions", {"prompt": "abc", "temperature": 0})
    body = {"model": "fake:latest", "prompt": "abc", "raw": True, "stream": False}
    r = await call(fake_app, "POST", "/api/generate", body={**body, "options": OPTIONS})
    assert r.status == 200, r.body
    got = r.json()
    assert got["response"] == want["choices"][0]["text"] and got["done"] is True
    assert got["done_reason"] == "length" and got["model"] == "fake"
    assert got["prompt_eval_count"] == want["usage"]["prompt_tokens"]
    assert got["eval_count"] == want["usage"]["completion_tokens"] == 10


async def test_chat_streams_lines_that_end_with_the_counts(fake_app):
    messages = [{"role": "user", "content": "hello"}]
    want = await completion(
        fake_app, "/v1/chat/completions", {"messages": messages, "temperature": 0}
    )
    body = {"model": "fake", "messages": messages, "options": OPTIONS}
    r = await call(fake_app, "POST", "/api/chat", body=body)
    assert r.status == 200 and r.header("content-type") == "application/x-ndjson"
    *parts, done = lines(r)
    assert all(not p["done"] and p["message"]["role"] == "assistant" for p in parts)
    text = "".join(p["message"]["content"] for p in parts)
    assert text == want["choices"][0]["message"]["content"]
    assert done["done"] is True and done["message"]["content"] == ""
    assert done["eval_count"] == 10 and done["prompt_eval_count"] > 0
    assert done["total_duration"] >= done["eval_duration"] >= 0


@pytest.mark.parametrize("stream", [False, True])
async def test_errors_are_ollamas_shape_with_their_status(fake_app, stream):
    for body, status, said in (
        ({"model": "nope", "prompt": "abc"}, 404, "does not exist"),
        ({"model": "fake", "prompt": "abc", "options": {"num_predict": 10**5}}, 400, "context"),
        ({"model": "fake", "prompt": "abc", "options": {"temperature": "hot"}}, 400, "temper"),
        ({"model": "fake", "prompt": "abc", "images": ["x"]}, 400, "Images"),
    ):
        r = await call(fake_app, "POST", "/api/generate", body={**body, "stream": stream})
        assert r.status == status, r.body
        assert set(r.json()) == {"error"} and said in r.json()["error"]


async def test_a_stream_cut_by_the_shutdown_ends_with_an_error_line(fake_model):
    inflight = InFlight()
    app = OpenAIApp(StaticDirectory([fake_model]), inflight, lambda: {})
    # greedy: sampled at ollama's default temperature, the fake's end token can come early
    body = {"model": "fake", "prompt": "abc", "options": {"num_predict": 200, "temperature": 0}}
    # 0.1 s in, it streams (200 tokens take 0.4 s)
    answer = await call_and(app, "POST", "/api/generate", inflight.expire_now, after=0.1, body=body)
    *parts, last = lines(answer)
    assert parts and all("response" in p for p in parts)
    assert "shut down" in last["error"]
