import pytest

from meshagent.api.errors import ApiError
from meshagent.api.schemas import ChatCompletionRequest, CompletionRequest, parse

MSGS = [{"role": "user", "content": "hi"}]


def test_valid_chat_request_with_content_parts():
    req = parse(
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
            "stop": "x",
            "max_completion_tokens": 7,
            "unknown_extra": 1,
        },
    )
    assert req.messages[0].text() == "a"
    assert req.stop_list() == ("x",)
    assert req.token_limit() == 7


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": MSGS}, "model"),
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": MSGS, "temperature": -1}, "temperature"),
        ({"model": "m", "messages": MSGS, "top_p": 0}, "top_p"),
        ({"model": "m", "messages": MSGS, "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": MSGS, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": "m", "messages": MSGS, "n": 9}, "n"),
        ({"model": "m", "messages": MSGS, "tools": [{"type": "function"}]}, "tools.0"),
        (
            {"model": "m", "messages": MSGS, "response_format": {"type": "yaml"}},
            "response_format.type",
        ),
        (
            {
                "model": "m",
                "messages": MSGS,
                "response_format": {"type": "json_schema", "json_schema": {}},
            },
            "response_format.json_schema",
        ),
        (
            {
                "model": "m",
                "messages": MSGS,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}},
                },
            },
            "response_format.json_schema.schema",
        ),
        ({"model": "m", "messages": MSGS, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"model": "m", "messages": MSGS, "logit_bias": {"42": 100}}, "logit_bias"),
        ({"model": "m", "messages": MSGS, "tool_choice": "required"}, "tool_choice"),
        ({"model": "m", "messages": MSGS, "functions": [{"name": "f"}]}, "functions"),
        ({"model": "m", "messages": MSGS, "function_call": "auto"}, "function_call"),
        ({"model": "m", "messages": MSGS, "top_logprobs": 2}, "top_logprobs"),
        ({"model": "m", "messages": MSGS, "modalities": ["text", "audio"]}, "modalities"),
        (
            {"model": "m", "messages": MSGS, "meshagent": {"speculation": "x"}},
            "meshagent.speculation",
        ),
        ({"model": "m", "messages": MSGS, "meshagent": {"speculate": "on"}}, "meshagent.speculate"),
    ],
)
def test_invalid_chat_requests_name_the_parameter(body, param):
    with pytest.raises(ApiError) as exc:
        parse(ChatCompletionRequest, body)
    assert exc.value.status == 400
    assert exc.value.param == param
    assert exc.value.body()["error"]["type"] == "invalid_request_error"


def test_body_must_be_an_object():
    with pytest.raises(ApiError) as exc:
        parse(ChatCompletionRequest, [1, 2])
    assert exc.value.status == 400


@pytest.mark.parametrize(
    ("prompt", "ok"),
    [("text", True), (["text"], True), ([1, 2, 3], True), ([], False), (["a", "b"], False)],
)
def test_completion_prompt_forms(prompt, ok):
    body = {"model": "m", "prompt": prompt}
    if ok:
        assert parse(CompletionRequest, body).max_tokens == 16
    else:
        with pytest.raises(ApiError):
            parse(CompletionRequest, body)


def test_fields_that_would_change_the_answer_are_refused_not_ignored():
    ok = {"model": "m", "messages": MSGS}
    # What changes nothing is accepted: plain text format, no bias, no tools chosen.
    for extra in (
        {"response_format": {"type": "text"}},
        {"logit_bias": {}},
        {"tool_choice": "none"},
        {"modalities": ["text"]},
        {"user": "someone", "parallel_tool_calls": False},
    ):
        parse(ChatCompletionRequest, {**ok, **extra})
    with pytest.raises(ApiError) as exc:
        parse(CompletionRequest, {"model": "m", "prompt": "x", "best_of": 3})
    assert (exc.value.param, exc.value.code) == ("best_of", "unsupported_parameter")
    with pytest.raises(ApiError) as exc:
        parse(CompletionRequest, {"model": "m", "prompt": "x", "logprobs": 2, "echo": True})
    assert (exc.value.param, exc.value.code) == ("echo", "unsupported_parameter")
