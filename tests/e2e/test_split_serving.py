"""Three agent processes, each too small for the model, negotiate a split and serve it."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from meshagent.sse_client import completion_text, iter_events
from meshagent.testing.structured_output import (
    MAX_TOKENS,
    PEOPLE,
    PERSON,
    TOOL_PROMPTS,
    TOOL_SCHEMAS,
    TOOLS,
    person_format,
    reference_logprobs,
)
from tests.e2e.agents import invite, wait_for
from tests.e2e.anthropic_checks import check_messages
from tests.e2e.test_openai_api import COPY

# SmolLM2 with 2 slots of 1024 tokens needs ~145 MB (weights + KV); with 10% headroom no
# agent offering 80 MB can hold it, two cannot either, three can.
SMALL = ["--max-memory", "80M", "--slots", "2", "--ctx-size", "1024", "--threads", "1"]
WHOLE = ["--slots", "2", "--ctx-size", "1024", "--threads", "1"]
PROMPT = "Name three rivers in Europe."
COMPLETION_PROMPT = "The three longest rivers in Europe are"


def _get(agent, path):
    return httpx.get(f"{agent.url}{path}", timeout=10).json()


def _request(agent, model_id, kind: str, stream: bool) -> tuple[str, httpx.Headers]:
    """One greedy request of 32 tokens; the text, assembled from the stream if streamed."""
    chat = kind == "chat"
    body = {"model": model_id, "max_tokens": 32, "temperature": 0, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = COMPLETION_PROMPT
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.stream("POST", f"{agent.url}{path}", json=body, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            raise AssertionError(r.text)
        if not stream:
            r.read()
            choice = r.json()["choices"][0]
            return (choice["message"]["content"] if chat else choice["text"]), r.headers
        return completion_text(iter_events(r)), r.headers


def _chat(agent, model_id):
    r = httpx.post(
        f"{agent.url}/v1/chat/completions",
        json={
            "model": model_id,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 32,
            "temperature": 0,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r


def _show_logs(agents) -> None:
    keys = (
        "placement.",
        "mesh_model",
        "split.",
        "stage.",
        "pipeline.",
        "conn.closed",
        "gossip.peer",
    )
    for y in agents:
        print("----", y.data_dir.name)
        print("\n".join(line for line in y.log_text().splitlines() if any(k in line for k in keys)))


def _structured_output_and_logprobs_as_the_whole_model(split, whole, model_id, model_path):
    """The grammar and the logprobs run at the last stage: JSON that validates, the whole
    model's JSON, and llama.cpp's own log-probabilities."""
    for who in PEOPLE[:3]:
        body = {
            "model": model_id,
            "messages": [{"role": "user", "content": f"Describe {who}."}],
            "response_format": person_format(),
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        said = [
            httpx.post(f"{x.url}/v1/chat/completions", json=body, timeout=120).json()
            for x in (split, whole)
        ]
        texts = [r["choices"][0]["message"]["content"] for r in said]
        jsonschema.validate(json.loads(texts[0]), PERSON)
        assert texts[0] == texts[1]
    for prompt in TOOL_PROMPTS[:2]:
        body = {
            "model": model_id,
            "messages": [{"role": "user", "content": prompt}],
            "tools": TOOLS,
            "tool_choice": "required",
            "max_tokens": 300,
            "temperature": 0,
        }
        said = [
            httpx.post(f"{x.url}/v1/chat/completions", json=body, timeout=120).json()
            for x in (split, whole)
        ]
        calls = [
            [
                (c["function"]["name"], c["function"]["arguments"])
                for c in r["choices"][0]["message"]["tool_calls"]
            ]
            for r in said
        ]
        assert calls[0] == calls[1] and said[0]["choices"][0]["finish_reason"] == "tool_calls"
        for name, arguments in calls[0]:
            jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS[name])
    prompt = "The capital of France is"
    ref = reference_logprobs(model_path, prompt, 6)
    body = {"model": model_id, "prompt": prompt, "max_tokens": len(ref), "temperature": 0}
    r = httpx.post(f"{split.url}/v1/completions", json={**body, "logprobs": 2}, timeout=120)
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [t.decode(errors="replace") for t, _ in ref]
    assert lp["token_logprobs"] == pytest.approx([v for _, v in ref], abs=1e-3)


def test_three_small_agents_serve_a_split(spawn_agent, model_id, model_path):
    # Default flags: the split must give the whole model's answers without being asked to.
    a = spawn_agent(*SMALL, name="a", wait_model=False)
    token = invite(a)
    b = spawn_agent(*SMALL, "--join", token, name="b", wait_model=False)
    c = spawn_agent(*SMALL, "--join", token, name="c", wait_model=False)
    agents = [a, b, c]
    # One agent serving the model whole with the same slots, context and threads (a mesh of
    # its own): the answers the split must give.
    whole = spawn_agent(*WHOLE, name="whole")

    def routable():
        return all(_get(x, "/control/status")["placement"][model_id]["routable"] for x in agents)

    wait_for(routable, timeout=120)
    placement = _get(a, "/control/status")["placement"][model_id]
    assert len(placement["stages"]) == 3
    ids = {_get(x, "/control/status")["peer_id"] for x in agents}
    assert {s[0] for s in placement["stages"]} == ids
    # No capability record for SmolLM2 here: f32 between stages, said to be uncertified.
    assert placement["wire"] == {
        "dtype": "f32",
        "certified_exact": False,
        "reason": "no certification record for this model: f32",
    }
    shapes = [(kind, stream) for kind in ("chat", "completion") for stream in (False, True)]
    expected = {shape: _request(whole, model_id, *shape)[0] for shape in shapes}
    assert all(expected.values())
    # Every agent, every request shape: the split's text is the whole model's.
    try:
        for x in agents:
            for shape in shapes:
                text, headers = _request(x, model_id, *shape)
                assert text == expected[shape], (x.data_dir.name, shape)
                assert len(headers["x-meshagent-stages"].split(",")) == 3
                assert headers["x-meshagent-wire-dtype"] == "f32"
                assert headers["x-meshagent-wire-exact"] == "no"
    except AssertionError:
        _show_logs(agents)
        raise
    # Embeddings need every layer on one agent: a split says so.
    r = httpx.post(f"{a.url}/v1/embeddings", json={"model": model_id, "input": "hello"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_split", r.text
    # The receipt: time in each stage (usage).
    stage_ms = _chat(a, model_id).json()["usage"]["meshagent"]["stage_ms"]
    assert len(stage_ms) == 3 and all(ms > 0 for ms in stage_ms)
    # Speculation through the split: the last stage verifies the
    # entry's drafts, and the text of copy-shaped and plain prompts is the whole model's.
    [entry] = [m for x in agents for m in _get(x, "/control/status")["models"]]
    assert entry["layers"][0] == 0 and entry["speculation"]["exact_windows"], entry
    # Kept prefixes through the split: the prompt asked before restarts from every stage's
    # kept KV of it, and gives the same text.
    assert entry["prefix_cache"]["on"], entry
    again = _chat(a, model_id).json()
    usage = again["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert again["choices"][0]["message"]["content"] == expected[("chat", False)]
    for messages in (COPY, [{"role": "user", "content": "What is 7 times 8?"}]):
        body = {"model": model_id, "messages": messages, "max_tokens": 60, "temperature": 0}
        plain = httpx.post(f"{whole.url}/v1/chat/completions", json=body, timeout=120).json()
        body["meshagent"] = {"speculation": "on"}
        split = httpx.post(f"{a.url}/v1/chat/completions", json=body, timeout=120).json()
        said = split["choices"][0]["message"]["content"]
        assert said == plain["choices"][0]["message"]["content"]
    assert split["usage"]["meshagent"]["speculation"]["windows"] > 0
    # With "on" the copy's drafts are mostly right; "auto" drafts where its cost model says it
    # pays (a figure for net-sim, not a test) and must give the same text.
    body = {"model": model_id, "messages": COPY, "max_tokens": 60, "temperature": 0}
    copied = {
        mode: httpx.post(
            f"{a.url}/v1/chat/completions",
            json={**body, "meshagent": {"speculation": mode}},
            timeout=120,
        ).json()
        for mode in ("on", "auto")
    }
    receipt = copied["on"]["usage"]["meshagent"]["speculation"]
    # ...and windows went down the chain before the verdicts on those before them.
    assert receipt["accepted"] > 20 and receipt["peak_windows_in_flight"] > 1
    said = {mode: r["choices"][0]["message"]["content"] for mode, r in copied.items()}
    assert said["on"] == said["auto"]
    _structured_output_and_logprobs_as_the_whole_model(a, whole, model_id, model_path)
    # Anthropic's Messages API through the split, as the whole model answers it.
    check_messages(a, model_id, whole)
    whole.stop()

    # c dies; a fourth agent with room for the whole model joins: the mesh replans.
    c.proc.kill()
    d = spawn_agent(
        "--max-memory",
        "1G",
        "--slots",
        "2",
        "--ctx-size",
        "1024",
        "--threads",
        "1",
        "--join",
        token,
        name="d",
    )
    d_id = _get(d, "/control/status")["peer_id"]

    def moved():
        p = _get(a, "/control/status")["placement"][model_id]
        return p["routable"] and p["replicas"] == [d_id]

    wait_for(moved, timeout=120)
    r = _chat(a, model_id)
    assert r.headers["x-meshagent-served-by"] == d_id
    assert r.json()["choices"][0]["message"]["content"]
