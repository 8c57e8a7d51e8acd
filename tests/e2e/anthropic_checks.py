"""Anthropic's Messages API through the official `anthropic` client, against a real agent:
shared by the whole-model test (test_anthropic_api.py) and the split (test_split_serving.py)."""

from __future__ import annotations

import json

import anthropic
import jsonschema

from meshagent.launch import AgentProcess

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
}
TOOLS = [
    {"name": "get_weather", "description": "The forecast for a city.", "input_schema": WEATHER}
]
ASK = [{"role": "user", "content": "Name three rivers in Europe."}]
# The client no longer takes sampling options (Claude's models dropped them); the API does.
GREEDY = {"temperature": 0}


def client_for(agent: AgentProcess, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=agent.url, api_key=key, max_retries=0, timeout=120)


def check_messages(agent: AgentProcess, model_id: str, whole: AgentProcess | None = None) -> None:
    """Plain and streamed messages, a forced tool use and its result, count_tokens, stop
    sequences and errors; with `whole`, every text must be the one it gives."""
    client = client_for(agent)
    reference = client_for(whole) if whole is not None else client

    plain = client.messages.create(model=model_id, max_tokens=40, messages=ASK, extra_body=GREEDY)
    assert plain.type == "message" and plain.role == "assistant" and plain.id.startswith("msg_")
    [block] = plain.content
    assert block.type == "text" and block.text
    assert plain.stop_reason in ("end_turn", "max_tokens")
    assert plain.usage.output_tokens > 0 and plain.usage.input_tokens > 0
    if whole is not None:
        ref = reference.messages.create(
            model=model_id, max_tokens=40, messages=ASK, extra_body=GREEDY
        )
        assert block.text == ref.content[0].text

    # Streamed: Anthropic's event sequence, read by the client into the same message.
    with client.messages.stream(
        model=model_id, max_tokens=40, messages=ASK, extra_body=GREEDY
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert final.content[0].text == block.text and final.stop_reason == plain.stop_reason

    # A stop sequence taken from the text ends it there, and says which.
    word = block.text.split()[1] if len(block.text.split()) > 1 else block.text[:2]
    stopped = client.messages.create(
        model=model_id, max_tokens=40, messages=ASK, extra_body=GREEDY, stop_sequences=[word]
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text

    # A forced tool use: its input follows the schema; then its result comes back.
    forced = client.messages.create(
        model=model_id,
        max_tokens=64,
        messages=[{"role": "user", "content": "What is the weather in Paris this week?"}],
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    assert forced.stop_reason == "tool_use"
    [use] = [b for b in forced.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    with client.messages.stream(
        model=model_id,
        max_tokens=64,
        messages=[{"role": "user", "content": "What is the weather in Paris this week?"}],
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    ) as stream:
        streamed = stream.get_final_message()
    [streamed_use] = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed.stop_reason == "tool_use" and streamed_use.input == use.input
    answered = client.messages.create(
        model=model_id,
        max_tokens=30,
        extra_body=GREEDY,
        tools=TOOLS,
        messages=[
            {"role": "user", "content": "What is the weather in Paris this week?"},
            {"role": "assistant", "content": [use.model_dump()]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}],
            },
        ],
    )
    assert answered.stop_reason in ("end_turn", "max_tokens", "tool_use")

    # Structured output (`output_config.format`): the reply validates against the schema.
    shaped = client.messages.create(
        model=model_id,
        max_tokens=48,
        messages=[{"role": "user", "content": "Plan a week of weather for Paris."}],
        output_config={"format": {"type": "json_schema", "schema": WEATHER}},
        extra_body=GREEDY,
    )
    jsonschema.validate(json.loads(shaped.content[0].text), WEATHER)

    # count_tokens: the prompt as the template renders it, as a message's usage counts it.
    counted = client.messages.count_tokens(model=model_id, messages=ASK)
    assert counted.input_tokens == plain.usage.input_tokens + (
        plain.usage.cache_read_input_tokens or 0
    )

    # Errors in Anthropic's shape, as its client reads them.
    try:
        client.messages.create(model="no-such-model", max_tokens=5, messages=ASK)
        raise AssertionError("an unknown model was answered")
    except anthropic.NotFoundError as e:
        assert e.body["type"] == "error" and e.body["error"]["type"] == "not_found_error"
    try:
        client.messages.create(
            model=model_id,
            max_tokens=5,
            messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],
        )
        raise AssertionError("an image was answered")
    except anthropic.BadRequestError as e:
        assert e.body["error"]["type"] == "invalid_request_error"
        assert "image" in e.body["error"]["message"]
