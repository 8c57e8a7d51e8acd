"""Anthropic's Messages request as a chat completion's (sans-IO), and its error shape."""

from __future__ import annotations

import json

import pytest

from meshagent.api.errors import ApiError
from meshagent.api.messages import error_body
from meshagent.api.messages_request import MessagesRequest
from meshagent.api.schemas import parse_body

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def request(**fields) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}]}
    req = parse_body(MessagesRequest, {**body, **fields})
    req.refuse_unsupported()
    return req


def test_turns_tool_uses_and_results_become_the_chat_history():
    req = request(
        system=[{"type": "text", "text": "Be brief."}],
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
    )
    chat = req.chat_messages()
    assert chat[0] == {"role": "system", "content": "Be brief."}
    assert chat[1] == {"role": "user", "content": "Weather in Oslo?"}
    call = chat[2]["tool_calls"][0]
    assert chat[2]["content"] == "Checking." and call["id"] == "toolu_1"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert chat[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"}
    assert chat[4] == {"role": "user", "content": "And tomorrow?"}


@pytest.mark.parametrize(
    "choice, chat_choice",
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "w"}, {"type": "function", "function": {"name": "w"}}),
    ],
)
def test_tools_and_tool_choice_map_to_chats(choice, chat_choice):
    tools = [{"name": "w", "description": "weather", "input_schema": WEATHER}]
    options = request(tools=tools, tool_choice=choice, stop_sequences=["\n\n"]).chat_options()
    assert options["tool_choice"] == chat_choice
    assert options["tools"][0]["function"]["parameters"] == WEATHER
    assert options["stop"] == ["\n\n"] and options["max_tokens"] == 32


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages.0.content.0"),
        ({"tools": [{"name": "s", "type": "web_search_20250305", "input_schema": {}}]},
         "tools.0.type"),
        ({"temperature": 1.5}, "temperature"),
        ({"output_config": {"format": {"type": "yaml"}}}, "output_config.format"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_refused_by_name(fields, param):
    with pytest.raises(ApiError) as e:
        req = request(**fields)
        req.chat_messages()
        req.chat_options()
    assert e.value.status == 400 and e.value.param == param


def test_extended_thinking_is_accepted_and_changes_nothing():
    thinking = request(thinking={"type": "enabled", "budget_tokens": 1024})
    assert thinking.chat_options() == request().chat_options()


def test_errors_take_anthropics_shape():
    body = error_body(ApiError(503, "busy"))
    assert body == {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    assert error_body(ApiError(418, "x"))["error"]["type"] == "api_error"
