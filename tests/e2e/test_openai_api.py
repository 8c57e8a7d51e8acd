"""The OpenAI-compatible API of a real agent process, driven by the official client."""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import openai
import pytest
from openai import OpenAI

from meshagent.launch import AgentProcess
from meshagent.sse_client import iter_events

HELLO = [{"role": "user", "content": "Write two sentences about the moon."}]


def test_models_lists_the_embedded_model(client: OpenAI, model_id: str) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [model_id]
    assert client.models.retrieve(model_id).id == model_id


def test_chat_completion(client: OpenAI, model_id: str) -> None:
    r = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=24)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 5
    assert 0 < r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_chat_matches_non_streaming(client: OpenAI, model_id: str) -> None:
    whole = client.chat.completions.create(
        model=model_id, messages=HELLO, max_tokens=32, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=model_id,
            messages=HELLO,
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    assert text == whole.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_repeated_prefix_is_reported_cached_and_changes_no_text(
    client: OpenAI, model_id: str
) -> None:
    # Unique from its first tokens, so that nothing an earlier test left behind shares it.
    system = f"Session {uuid.uuid4().hex}. You answer briefly and precisely. " * 4
    ask = [{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}]
    first = client.chat.completions.create(
        model=model_id, messages=ask, max_tokens=16, temperature=0
    )
    second = client.chat.completions.create(
        model=model_id, messages=ask, max_tokens=16, temperature=0
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    assert second.choices[0].message.content == first.choices[0].message.content
    other = [ask[0], {"role": "user", "content": "Name a colour."}]
    chunks = list(
        client.chat.completions.create(
            model=model_id,
            messages=other,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert 40 < cached < chunks[-1].usage.prompt_tokens


def test_temperature_zero_is_deterministic(client: OpenAI, model_id: str) -> None:
    texts = {
        client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=40, temperature=0)
        .choices[0]
        .message.content
        for _ in range(2)
    }
    assert len(texts) == 1


def test_seed_makes_sampling_reproducible(client: OpenAI, model_id: str) -> None:
    def sample(seed: int) -> str:
        r = client.chat.completions.create(
            model=model_id, messages=HELLO, max_tokens=40, temperature=1.0, seed=seed
        )
        return r.choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_max_tokens_is_honoured(client: OpenAI, model_id: str) -> None:
    r = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=5)
    assert r.usage.completion_tokens == 5
    assert r.choices[0].finish_reason == "length"
    c = client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=7)
    assert c.usage.completion_tokens == 7
    assert c.choices[0].finish_reason == "length"


def test_stop_is_honoured(client: OpenAI, model_id: str) -> None:
    full = (
        client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=48, temperature=0)
        .choices[0]
        .message.content
    )
    # A stop string from the middle of the greedy answer cuts it right there.
    words = full.split()
    assert len(words) > 6, full
    stop = " " + words[4]
    expected = full[: full.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = client.chat.completions.create(
                model=model_id,
                messages=HELLO,
                max_tokens=48,
                temperature=0,
                stop=[stop, "never-appears"],
                stream=True,
            )
            parts, finish = [], None
            for c in chunks:
                parts.append(c.choices[0].delta.content or "")
                finish = c.choices[0].finish_reason or finish
            text = "".join(parts)
        else:
            r = client.chat.completions.create(
                model=model_id, messages=HELLO, max_tokens=48, temperature=0, stop=stop
            )
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert text == expected
        assert finish == "stop"


def test_text_completion_streaming_and_echo(client: OpenAI, model_id: str) -> None:
    prompt = "The three primary colours are"
    chunks = list(
        client.completions.create(
            model=model_id, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
    )
    streamed = "".join(c.choices[0].text for c in chunks)
    whole = client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0)
    assert streamed == whole.choices[0].text
    echoed = client.completions.create(
        model=model_id, prompt=prompt, max_tokens=12, temperature=0, echo=True
    )
    assert echoed.choices[0].text == prompt + whole.choices[0].text


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def test_invalid_json_is_a_400(agent: AgentProcess) -> None:
    r = httpx.post(
        f"{agent.url}/v1/chat/completions",
        content=b'{"model": "x", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    err = _error(r)
    assert err["type"] == "invalid_request_error"
    assert "JSON" in err["message"]


def test_missing_field_is_a_400_naming_it(client: OpenAI, model_id: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model_id, messages=None)  # type: ignore[arg-type]
    assert exc.value.status_code == 400
    assert exc.value.body["param"] == "messages"
    r = httpx.post(f"{client.base_url}chat/completions", json={"messages": HELLO})
    assert r.status_code == 400
    assert _error(r)["param"] == "model"


def test_bad_value_is_a_400(client: OpenAI, model_id: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model_id, messages=HELLO, temperature=5)
    assert exc.value.body["param"] == "temperature"


def test_unknown_model_is_a_404(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="no-such-model", messages=HELLO)
    assert exc.value.status_code == 404
    assert exc.value.body["code"] == "model_not_found"
    assert "no-such-model" in exc.value.body["message"]


def test_context_overflow_is_a_400(client: OpenAI, model_id: str) -> None:
    long = [{"role": "user", "content": "word " * 5000}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model_id, messages=long, max_tokens=8)
    assert exc.value.body["code"] == "context_length_exceeded"
    assert "maximum context length" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=100_000)
    assert exc.value.body["code"] == "context_length_exceeded"


def test_unknown_endpoint_and_method(agent: AgentProcess) -> None:
    r = httpx.get(f"{agent.url}/v1/nothing")
    assert r.status_code == 404
    _error(r)
    r = httpx.get(f"{agent.url}/v1/chat/completions")
    assert r.status_code == 405
    _error(r)


def test_health_and_control_status(agent: AgentProcess, model_id: str) -> None:
    assert httpx.get(f"{agent.url}/health").json() == {"status": "ok"}
    st = httpx.get(f"{agent.url}/control/status").json()
    assert st["state"] == "serving"
    assert st["api"] == agent.url
    assert st["models"][0]["id"] == model_id
    assert len(st["peer_id"]) == 26


def test_eight_concurrent_streams_complete(client: OpenAI, model_id: str) -> None:
    results: dict[int, tuple[str, str | None]] = {}

    def one(i: int) -> None:
        stream = client.chat.completions.create(
            model=model_id,
            messages=[{"role": "user", "content": f"Count from {i} to {i + 10}."}],
            max_tokens=24,
            stream=True,
        )
        text, finish = "", None
        for c in stream:
            text += c.choices[0].delta.content or ""
            finish = c.choices[0].finish_reason or finish
        results[i] = (text, finish)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == list(range(8))
    for text, finish in results.values():
        assert text
        assert finish in ("stop", "length")


def test_client_killed_mid_stream_frees_its_slot(agent: AgentProcess, model_id: str) -> None:
    others: dict[int, str | None] = {}

    def steady(i: int) -> None:
        c = OpenAI(base_url=f"{agent.url}/v1", api_key="x", max_retries=0)
        finish = None
        for chunk in c.chat.completions.create(
            model=model_id, messages=HELLO, max_tokens=64, stream=True
        ):
            finish = chunk.choices[0].finish_reason or finish
        others[i] = finish

    threads = [threading.Thread(target=steady, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    body = {"model": model_id, "messages": HELLO, "max_tokens": 1500, "stream": True}
    with httpx.stream("POST", f"{agent.url}/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any('"content"' in line for line in got)
        # Leaving the block drops the connection mid-stream.
    for t in threads:
        t.join(timeout=120)
    assert sorted(others) == [0, 1]
    assert all(f in ("stop", "length") for f in others.values())
    # The dropped request no longer holds a slot nor counts as in flight.
    for _ in range(100):
        st = httpx.get(f"{agent.url}/control/status").json()
        if st["in_flight"] == 0 and st["models"][0]["slots"]["active"] == 0:
            break
        threading.Event().wait(0.05)
    assert st["in_flight"] == 0
    assert st["models"][0]["slots"]["active"] == 0


def test_sse_is_incremental(agent: AgentProcess, model_id: str) -> None:
    """The first token reaches the client while the request is still generating."""
    # Counting keeps a greedy model going until max_tokens.
    body = {
        "model": model_id,
        "prompt": "1, 2, 3, 4, 5, 6,",
        "max_tokens": 300,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{agent.url}/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = iter_events(r)  # one iterator: dropping it would close the response
        for event in events:
            if event.json()["choices"][0]["text"]:
                break
        st = httpx.get(f"{agent.url}/control/status").json()
        assert st["in_flight"] == 1
        rest = list(events)
    assert rest[-1].done


DOC = json.dumps(
    {"name": "meshagent", "version": "0.1.0", "tags": ["mesh", "llm", "p2p"], "port": 9337},
    indent=2,
)
COPY = [
    {
        "role": "user",
        "content": f"Here is a JSON document:\n{DOC}\nRepeat it exactly, with the port set to "
        "9400.",
    }
]


def test_speculation_changes_no_token_and_its_receipt_counts_the_drafts(
    agent: AgentProcess, client: OpenAI, model_id: str
) -> None:
    # The agent checked at load that llama.cpp computes a draft's window exactly as it
    # computes one-token steps, so drafting ("auto", the default) changes no token, chat and
    # text completions, whole and streamed: copy-shaped text where drafts are mostly right, and
    # short chat answers where two tokens nearly tie within a few tokens (before the window
    # check and a build without LLAMAFILE, two of these three changed; docs/speculation.md).
    [model] = httpx.get(f"{agent.url}/control/status").json()["models"]
    assert model["speculation"]["default"] == "auto"
    assert model["speculation"]["exact_windows"], model["speculation"]["reason"]

    def ask(mode: str | None, messages=COPY, **kw):
        extra = {} if mode is None else {"meshagent": {"speculation": mode}}
        return client.chat.completions.create(
            model=model_id, messages=messages, max_tokens=80, temperature=0, extra_body=extra, **kw
        )

    # "on" drafts whatever the window costs; "auto" (the default) drafts only where the windows
    # it measured on this machine pay, so how much it drafts is a benchmark's figure
    # (bench/speculation.py), not a test's: here it must only change no token.
    plain, spec, auto = ask("off"), ask("on"), ask(None)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert auto.choices[0].message.content == plain.choices[0].message.content
    receipt = spec.usage.model_extra["meshagent"]["speculation"]
    assert receipt["accepted"] > 20 and receipt["drafted"] >= receipt["accepted"]
    assert "meshagent" not in (plain.usage.model_extra or {})
    streamed = "".join(
        c.choices[0].delta.content or "" for c in ask("on", stream=True) if c.choices
    )
    assert streamed == plain.choices[0].message.content
    for question in ("What is 7 times 8?", "Write a haiku about rivers.", "Name three colours."):
        chat = [{"role": "user", "content": question}]
        texts = {mode: ask(mode, chat).choices[0].message.content for mode in ("off", "on")}
        assert texts["on"] == texts["off"], question
    prompt = "def add(a, b):\n    return a + b\n\ndef add(x, y):\n    return"
    text = {
        mode: client.completions.create(
            model=model_id,
            prompt=prompt,
            max_tokens=60,
            temperature=0,
            extra_body={"meshagent": {"speculation": mode}},
        )
        .choices[0]
        .text
        for mode in ("off", "on", "auto")
    }
    assert text["on"] == text["off"] == text["auto"]
    # The agent timed its decode steps by their tokens: one-token steps and windows.
    [model] = httpx.get(f"{agent.url}/control/status").json()["models"]
    steps = model["speculation"]["window_cost"]["steps"]
    assert steps["1"]["count"] > 0 and steps["1"]["mean_ms"] > 0
    windows = {int(n): v for n, v in steps.items() if int(n) > 1}
    assert windows and all(v["count"] > 0 and v["mean_ms"] > 0 for v in windows.values())


def test_a_bad_speculation_choice_is_a_400(agent: AgentProcess, model_id: str) -> None:
    r = httpx.post(
        f"{agent.url}/v1/completions",
        json={"model": model_id, "prompt": "x", "meshagent": {"speculation": "always"}},
    )
    assert r.status_code == 400
    assert _error(r)["param"] == "meshagent.speculation"


def _scrape(agent: AgentProcess) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{agent.url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def test_metrics_move_with_requests(agent: AgentProcess, client: OpenAI, model_id: str) -> None:
    before = _scrape(agent)
    model = ("model", model_id)
    ok = frozenset({model, ("path", "local"), ("status", "200")})
    bad = frozenset({model, ("path", "local"), ("status", "400")})
    chunks = list(
        client.chat.completions.create(
            model=model_id,
            messages=HELLO,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    tokens = chunks[-1].usage.completion_tokens
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=-1)
    after = _scrape(agent)

    def moved(name: str, labels: frozenset) -> float:
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert moved("meshagent_requests_total", ok) == 1
    assert moved("meshagent_requests_total", bad) == 1
    assert moved("meshagent_completion_tokens_total", frozenset({model})) == tokens
    timed = frozenset({model, ("path", "local")})
    assert moved("meshagent_time_to_first_token_seconds_count", timed) == 1
    assert moved("meshagent_time_per_output_token_seconds_count", timed) == 1
    assert after[("meshagent_slots", frozenset({model}))] >= 1
    assert after[("meshagent_placement_routable", frozenset({model}))] == 1
    assert moved("meshagent_tokens_processed_total", frozenset({model})) >= tokens


def test_embeddings_put_paraphrases_closer_than_unrelated_text(
    agent: AgentProcess, client: OpenAI, model_id: str
) -> None:
    import numpy as np

    texts = [
        "The cat sat on the mat.",
        "A cat was sitting on the rug.",
        "Quarterly revenue rose by eight percent.",
    ]
    # The official client asks for base64 floats by default and decodes them.
    r = client.embeddings.create(model=model_id, input=texts)
    vectors = np.array([d.embedding for d in sorted(r.data, key=lambda d: d.index)])
    assert vectors.shape[0] == 3 and vectors.shape[1] > 100
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3)
    paraphrase, unrelated = vectors[0] @ vectors[1], vectors[0] @ vectors[2]
    assert paraphrase > unrelated, (paraphrase, unrelated)
    assert r.usage.prompt_tokens > 10
    # Floats, asked for as such, are the same vectors.
    body = {"model": model_id, "input": texts[0], "encoding_format": "float"}
    one = httpx.post(f"{agent.url}/v1/embeddings", json=body, timeout=60).json()
    assert np.allclose(one["data"][0]["embedding"], vectors[0], atol=1e-5)
    # What cannot be honoured is refused, naming the field.
    for bad, param in (
        ({"input": [[1, 2, 3]]}, "input"),
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": []}, "input"),
    ):
        r = httpx.post(f"{agent.url}/v1/embeddings", json={"model": model_id, **bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(f"{agent.url}/v1/embeddings", json={"model": "nope", "input": "x"}, timeout=60)
    assert r.status_code == 404


def test_the_responses_api_through_the_official_client(
    agent: AgentProcess, client: OpenAI, model_id: str
) -> None:
    ask = {"model": model_id, "input": "Name a colour.", "max_output_tokens": 12, "temperature": 0}
    # Greedy: the same text as the chat endpoint gives for the same conversation.
    chat = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=12, temperature=0,
    )  # fmt: skip
    whole = client.responses.create(**ask)
    assert whole.status in ("completed", "incomplete") and whole.id.startswith("resp_")
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # Instructions and a previous response carry the conversation on.
    again = client.responses.create(
        model=model_id,
        input="And another one?",
        instructions="Answer in one word.",
        previous_response_id=whole.id,
        max_output_tokens=8,
    )
    assert again.output_text and again.previous_response_id == whole.id
    assert again.usage.input_tokens > whole.usage.input_tokens  # the history came along
    # What would not be honoured is refused, naming it.
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_id, input="hi", tools=[{"type": "web_search"}])
    assert e.value.param == "tools.0.type"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=model_id, input="hi", previous_response_id="resp_nope")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="hi")


def test_ollamas_endpoints_through_the_ollama_client(agent: AgentProcess, model_id: str) -> None:
    import ollama

    client = ollama.Client(host=agent.url)
    assert [m.model for m in client.list().models] == [model_id]
    messages = [{"role": "user", "content": "Name a colour."}]
    options = {"temperature": 0, "num_predict": 12}
    whole = client.chat(model=f"{model_id}:latest", messages=messages, options=options)
    assert whole.done and whole.message.role == "assistant" and whole.message.content
    assert whole.eval_count and whole.prompt_eval_count and whole.done_reason in ("stop", "length")
    parts = list(client.chat(model=model_id, messages=messages, options=options, stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == whole.message.content
    # The same greedy text as the OpenAI endpoint gives.
    body = {"model": model_id, "messages": messages, "max_tokens": 12, "temperature": 0}
    chat = httpx.post(f"{agent.url}/v1/chat/completions", json=body, timeout=60).json()
    assert whole.message.content == chat["choices"][0]["message"]["content"]
    gen = client.generate(model=model_id, prompt="Name a colour.", options=options)
    assert gen.response == whole.message.content  # through the chat template, as ollama does
    raw = list(client.generate(model=model_id, prompt="The sky is", raw=True, stream=True,
                               options={"temperature": 0, "num_predict": 6}))  # fmt: skip
    assert raw[-1].done and "".join(p.response for p in raw).strip()
    # format (JSON, or a schema) and tools, enforced as on the OpenAI endpoints.
    shaped = client.chat(
        model=model_id,
        messages=messages,
        format="json",
        options={"num_predict": 200, "temperature": 0},
    )
    assert isinstance(json.loads(shaped.message.content), dict)
    from meshagent.testing.structured_output import TOOL_SCHEMAS, TOOLS

    called = client.chat(
        model=model_id,
        messages=[{"role": "user", "content": "Add 2 and 40."}],
        tools=TOOLS,
        options={"temperature": 0, "num_predict": 200},
    )
    for call in called.message.tool_calls or ():
        import jsonschema

        jsonschema.validate(dict(call.function.arguments), TOOL_SCHEMAS[call.function.name])
    body = {"model": model_id, "messages": messages, "format": "yaml"}  # the client refuses it
    r = httpx.post(f"{agent.url}/api/chat", json=body, timeout=30)
    assert r.status_code == 400 and "format" in r.json()["error"]
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=messages)
    assert e.value.status_code == 404


def test_a_client_leaving_a_responses_stream_stops_its_generation(
    agent: AgentProcess, model_id: str
) -> None:
    gone = frozenset({("model", model_id), ("path", "local"), ("status", "client_gone")})
    before = _scrape(agent).get(("meshagent_requests_total", gone), 0)
    body = {"model": model_id, "input": "Tell me a long story.", "max_output_tokens": 400,
            "stream": True, "temperature": 0}  # fmt: skip
    with httpx.stream("POST", f"{agent.url}/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if "response.output_text.delta" in line:
                break  # leave mid-stream
    deadline = time.monotonic() + 10
    while _scrape(agent).get(("meshagent_requests_total", gone), 0) == before:
        assert time.monotonic() < deadline, "the generation went on without its client"
        time.sleep(0.1)
    # The slot is freed when the token being computed as the client left comes back.
    busy = ("meshagent_slots_busy", frozenset({("model", model_id)}))
    while _scrape(agent)[busy] != 0:
        assert time.monotonic() < deadline, "the slot stayed busy after its client left"
        time.sleep(0.05)


def test_json_schema_output_validates_and_json_object_parses(client: OpenAI, model_id: str) -> None:
    import jsonschema

    from meshagent.testing.structured_output import MAX_TOKENS, PEOPLE, PERSON, person_format

    for who in PEOPLE:
        r = client.chat.completions.create(
            model=model_id,
            messages=[{"role": "user", "content": f"Describe {who}."}],
            response_format=person_format(),
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    # Streamed, sampled, and any JSON object.
    stream = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "Give two colours as JSON."}],
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0.7,
        seed=5,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)


def test_logprobs_are_llama_cpps_log_softmax(
    agent: AgentProcess, client: OpenAI, model_id: str, model_path
) -> None:
    from meshagent.testing.structured_output import reference_logprobs

    prompt = "The capital of France is"
    ref = reference_logprobs(model_path, prompt, 6)
    r = client.completions.create(
        model=model_id, prompt=prompt, max_tokens=len(ref), temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert lp.tokens == [t.decode(errors="replace") for t, _ in ref]
    assert lp.token_logprobs == pytest.approx([v for _, v in ref], abs=1e-4)
    # The chosen (greedy) token is the likeliest: the first of the top three.
    assert [max(top, key=top.get) for top in lp.top_logprobs] == lp.tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # Chat, whole and streamed: each token once, with its alternatives, most likely first.
    body = dict(
        model=model_id,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    whole = client.chat.completions.create(**body)
    content = whole.choices[0].logprobs.content
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob for e in content)
    assert all(bytes(e.bytes).decode(errors="replace") == e.token for e in content)
    streamed = [
        e
        for c in client.chat.completions.create(**body, stream=True)
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    r = httpx.post(
        f"{agent.url}/v1/chat/completions",
        json={**body, "top_logprobs": 21},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_forced_tool_calls_follow_their_schemas_whole_and_streamed(
    client: OpenAI, model_id: str
) -> None:
    import jsonschema

    from meshagent.testing.structured_output import TOOL_PROMPTS, TOOL_SCHEMAS, TOOLS

    named = {"type": "function", "function": {"name": "get_weather"}}
    for prompt in TOOL_PROMPTS:
        for choice in ("required", named):
            r = client.chat.completions.create(
                model=model_id,
                messages=[{"role": "user", "content": prompt}],
                tools=TOOLS,
                tool_choice=choice,
                max_tokens=300,
                temperature=0,
            )
            assert r.choices[0].finish_reason == "tool_calls"
            calls = r.choices[0].message.tool_calls
            assert calls and len({c.id for c in calls}) == len(calls)
            for call in calls:
                assert choice == "required" or call.function.name == "get_weather"
                jsonschema.validate(
                    json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name]
                )
    # Streamed: the calls arrive as delta.tool_calls and reassemble to valid JSON.
    stream = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "Add 2 and 40."}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=False,
        max_tokens=100,
        temperature=0,
        stream=True,
    )
    parts: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        for tc in chunk.choices[0].delta.tool_calls or ():
            part = parts.setdefault(tc.index, ["", ""])
            part[0] += tc.function.name or ""
            part[1] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(parts) == [0] and parts[0][0] == "add"
    jsonschema.validate(json.loads(parts[0][1]), TOOL_SCHEMAS["add"])
    # A history with a call and its result is accepted, tools offered or not.
    history = [
        {"role": "user", "content": "Add 2 and 40."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 40}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    for tools in (TOOLS, None):
        extra = {"tools": tools} if tools else {}
        r = client.chat.completions.create(
            model=model_id, messages=history, max_tokens=20, temperature=0, **extra
        )
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_forced_calls_end_cleanly_at_any_token_limit_whole_and_streamed(
    client: OpenAI, model_id: str
) -> None:
    # The call grammar closes before the limit: the calls are whole, the reply ends there
    # with `tool_calls`, no markup is left as content, and a stream's argument deltas (as
    # they are written) join into the arguments the whole reply carries.
    import jsonschema

    from meshagent.testing.structured_output import TOOL_SCHEMAS, TOOLS

    named = {"type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": "What is the weather in Paris and Rome this week?"}]
    for choice in ("required", named):
        for limit in (64, 512):
            body = dict(
                model=model_id,
                messages=messages,
                tools=TOOLS,
                tool_choice=choice,
                max_tokens=limit,
                temperature=0,
            )
            whole = client.chat.completions.create(**body).choices[0]
            assert whole.finish_reason == "tool_calls", (choice, limit)
            assert whole.message.content is None, whole.message.content
            calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
            for name, arguments in calls:
                jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS[name])
            parts: dict[int, list] = {}
            finish, content = None, ""
            for chunk in client.chat.completions.create(**body, stream=True):
                if not chunk.choices:
                    continue
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for tc in delta.tool_calls or ():
                    part = parts.setdefault(tc.index, ["", "", 0])
                    part[0] += tc.function.name or ""
                    part[1] += tc.function.arguments or ""
                    part[2] += 1
                finish = chunk.choices[0].finish_reason or finish
            assert finish == "tool_calls" and not content.strip()
            assert [(n, a) for n, a, _ in parts.values()] == calls
            assert all(chunks > 2 for _, _, chunks in parts.values())  # written as they came


def test_a_strict_schema_with_unbounded_parts_validates_at_any_limit(
    client: OpenAI, model_id: str
) -> None:
    import jsonschema

    from meshagent.testing.structured_output import TAGS as schema

    fmt = {"type": "json_schema", "json_schema": {"name": "post", "schema": schema, "strict": True}}
    ask = "Give a title and as many tags as you can for a long blog post about cooking pasta."
    for limit in (48, 96, 200):
        r = client.chat.completions.create(
            model=model_id,
            messages=[{"role": "user", "content": ask}],
            response_format=fmt,
            max_tokens=limit,
            temperature=0,
        )
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        assert r.usage.completion_tokens <= limit


def test_bad_tools_are_400s_naming_the_field(agent: AgentProcess, model_id: str) -> None:
    from meshagent.testing.structured_output import TOOLS

    base = {"model": model_id, "messages": [{"role": "user", "content": "hi"}]}
    for extra, param in (
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools.0.function.name",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"n": {"type": "number", "maximum": 3}},
                            },
                        },
                    }
                ]
            },
            "tools.0.function.parameters.properties.n.maximum",
        ),
    ):
        r = httpx.post(f"{agent.url}/v1/chat/completions", json={**base, **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_n_choices_share_one_prefill(agent: AgentProcess, client: OpenAI, model_id: str) -> None:
    # A prompt no earlier test sent: nothing of it is kept yet.
    messages = [{"role": "user", "content": f"Name a colour. {uuid.uuid4().hex}"}]
    key = ("meshagent_tokens_processed_total", frozenset({("model", model_id)}))
    before = _scrape(agent)[key]
    r = client.chat.completions.create(
        model=model_id,
        messages=messages,
        n=4,
        max_tokens=12,
        temperature=1.0,
        seed=11,
        extra_body={"meshagent": {"speculation": "off"}},  # rejected drafts would count
    )
    processed = _scrape(agent)[key] - before
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert len({c.message.content for c in r.choices}) > 1  # each choice samples its own
    # One prefill of the prompt, then each choice's last prompt token and its own tokens.
    # (The template's opening may be kept from earlier requests: cached_tokens says how much.)
    prompt = r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens
    completion = r.usage.completion_tokens
    assert processed <= prompt + 3 + completion, (processed, prompt, completion)
    assert processed >= prompt + 3 + completion - 4
    # Choice i samples with seed + i: the first is the request alone with the same seed.
    alone = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=12, temperature=1.0, seed=11
    )
    assert alone.choices[0].message.content == r.choices[0].message.content
    # Streamed: every choice's chunks name its index, and each ends with a finish reason.
    ends = {}
    for chunk in client.chat.completions.create(
        model=model_id, messages=messages, n=3, max_tokens=6, temperature=1.0, seed=2, stream=True
    ):
        for c in chunk.choices:
            if c.finish_reason:
                ends[c.index] = c.finish_reason
    assert sorted(ends) == [0, 1, 2]


def test_the_responses_api_calls_functions_and_follows_a_json_schema(
    client: OpenAI, model_id: str
) -> None:
    import jsonschema

    from meshagent.testing.structured_output import MAX_TOKENS, PERSON, TOOL_SCHEMAS, TOOLS

    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    ask = dict(
        model=model_id,
        input="What is the weather in Rome?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0,
    )
    whole = client.responses.create(**ask)
    [call] = [o for o in whole.output if o.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), TOOL_SCHEMAS["get_weather"])
    events = list(client.responses.create(**ask, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]
    # The arguments stream as they are written, and join into the whole call's.
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 2 and "".join(deltas) == call.arguments
    assert events[-1].type == "response.completed"
    # At a tight limit the forced call still closes: the response completes with it.
    tight = client.responses.create(**{**ask, "max_output_tokens": 40})
    assert tight.status == "completed" and not tight.output_text
    [short] = [o for o in tight.output if o.type == "function_call"]
    jsonschema.validate(json.loads(short.arguments), TOOL_SCHEMAS["get_weather"])
    # The call's output goes back in, and the model answers on.
    after = client.responses.create(
        model=model_id,
        previous_response_id=whole.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24C"}],
        tools=tools,
        max_output_tokens=20,
        temperature=0,
    )
    assert after.status in ("completed", "incomplete")
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    shaped = client.responses.create(
        model=model_id,
        input="Describe a sailor.",
        text={"format": fmt},
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    jsonschema.validate(json.loads(shaped.output_text), PERSON)
