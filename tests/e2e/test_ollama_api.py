"""Ollama's API through the official `ollama` client, as chat front ends and editor plugins
call it: version, list, show, ps, embed, pull (from a local hub), chat with tools, generate,
fill in the middle, and options mapped or refused by name (chat and generate themselves:
tests/e2e/test_openai_api.py)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest

from meshagent.launch import AgentProcess
from meshagent.testing.structured_output import TOOL_SCHEMAS, TOOLS
from meshagent.testing.tiny_gguf import write_tiny_model
from tests.models.fake_hub import FakeHub


@pytest.fixture
def model_id(agent: AgentProcess) -> str:
    return httpx.get(f"{agent.url}/v1/models", timeout=30).json()["data"][0]["id"]


def test_the_calls_tools_make_first(agent: AgentProcess, model_id: str) -> None:
    client = ollama.Client(host=agent.url)
    assert httpx.get(f"{agent.url}/api/version").json()["version"].count(".") == 2
    assert [m.model for m in client.list().models] == [model_id]
    shown = client.show(model_id)
    assert shown.details.format == "gguf" and shown.details.family == "llama"
    assert shown.modelinfo["general.architecture"] == "llama"
    assert "tools" in shown.capabilities and "embedding" in shown.capabilities
    assert "im_start" in shown.template  # SmolLM2's own chat template
    [running] = client.ps().models
    assert running.model == model_id
    with pytest.raises(ollama.ResponseError) as e:
        client.show("nope")
    assert e.value.status_code == 404


def test_embeddings_as_ollama_gives_them(agent: AgentProcess, model_id: str) -> None:
    client = ollama.Client(host=agent.url)
    got = client.embed(model=model_id, input=["a red fox", "a blue sea"])
    assert len(got.embeddings) == 2 and got.prompt_eval_count > 0
    # The same vectors as the OpenAI endpoint gives.
    body = {"model": model_id, "input": ["a red fox", "a blue sea"]}
    ours = httpx.post(f"{agent.url}/v1/embeddings", json=body, timeout=60).json()
    assert got.embeddings == [d["embedding"] for d in ours["data"]]
    old = client.embeddings(model=model_id, prompt="a red fox")
    assert list(old.embedding) == got.embeddings[0]


def test_options_are_mapped_or_refused_by_name(agent: AgentProcess, model_id: str) -> None:
    client = ollama.Client(host=agent.url)
    messages = [{"role": "user", "content": "Name a colour."}]
    # The agent's own settings are accepted; top_k and repeat_penalty are sampling options.
    options = {"temperature": 0, "num_predict": 8, "num_ctx": 4096, "top_k": 5, "num_thread": 2}
    greedy = client.chat(model=model_id, messages=messages, options=options)
    assert greedy.message.content
    sampled = client.chat(
        model=model_id,
        messages=messages,
        options={"temperature": 0.8, "top_k": 1, "num_predict": 8, "repeat_penalty": 1.1},
    )
    assert sampled.message.content  # top_k 1 keeps one token at every step
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=model_id, messages=messages, options={"mirostat": 2})
    assert e.value.status_code == 400 and "mirostat" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=model_id, prompt="hi", images=[b"\x89PNG"])
    assert e.value.status_code == 400 and "mage" in e.value.error


def test_a_forced_looking_tool_chat_ends_in_calls(agent: AgentProcess, model_id: str) -> None:
    client = ollama.Client(host=agent.url)
    called = client.chat(
        model=model_id,
        messages=[{"role": "user", "content": "Add 2 and 40."}],
        tools=TOOLS,
        options={"temperature": 0, "num_predict": 64},
    )
    for call in called.message.tool_calls or ():
        jsonschema.validate(dict(call.function.arguments), TOOL_SCHEMAS[call.function.name])
    if called.message.tool_calls:
        assert "<tool_call>" not in (called.message.content or "")


def test_pull_adds_a_hub_model_with_progress_and_fim_follows_its_tokens(
    spawn_agent, tmp_path, monkeypatch, model_path
) -> None:
    # A code-shaped tiny model with fill-in-the-middle tokens, on a local hub.
    coder = write_tiny_model(tmp_path / "tiny-coder-Q8_0.gguf", "qwen2", fim=True)
    hub = FakeHub({"org/tiny-coder-GGUF": {coder.name: coder.read_bytes()}})
    try:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
        agent = spawn_agent("--slots", "2", "--ctx-size", "512", "--threads", "1")
        client = ollama.Client(host=agent.url)
        steps = list(client.pull("org/tiny-coder-GGUF:Q8_0", stream=True))
        assert steps[0].status == "pulling manifest" and steps[-1].status == "success"
        sized = [s for s in steps if s.total]
        assert sized and sized[-1].completed == sized[-1].total == coder.stat().st_size
        name = coder.stem
        assert name in [m.model for m in client.list().models]
        # Fill in the middle: the model's own tokens around the prompt and the suffix.
        filled = client.generate(
            model=name,
            prompt="def add(a, b):\n    return ",
            suffix="\n\nprint(add(1, 2))\n",
            options={"temperature": 0, "num_predict": 6},
        )
        assert filled.done and filled.prompt_eval_count > 0
        # A model without such tokens (the embedded SmolLM2) says so.
        r = httpx.post(
            f"{agent.url}/v1/completions",
            json={"model": model_path.stem, "prompt": "x", "suffix": "y", "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        assert "fill-in-the-middle" in r.json()["error"]["message"]
    finally:
        hub.close()


def test_ollamas_port_serves_ollamas_api_too(spawn_agent) -> None:
    # (Port 0 here: any free one, as the run file says; 11434 is ollama's own.)
    agent = spawn_agent("--ollama-port", "0", "--slots", "1", "--threads", "1")
    run = json.loads((agent.data_dir / "agent.json").read_text())
    assert run["ollama"] and run["ollama"] != run["api"]
    client = ollama.Client(host=run["ollama"])
    [listed] = client.list().models
    reply = client.generate(
        model=listed.model, prompt="The sky is", options={"temperature": 0, "num_predict": 4}
    )
    assert reply.done and reply.response
