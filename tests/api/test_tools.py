"""Tool calls without a model: the request's tools are checked, the history is written for
templates with and without tools, the grammar makes any walk through it a valid call of the
right function, and the output parser finds the calls in every syntax, streamed or not."""

from __future__ import annotations

import json

import jsonschema
import pytest

from meshagent.api.errors import ApiError
from meshagent.api.tools import (
    HERMES,
    LLAMA3,
    MISTRAL,
    ArgsDelta,
    Call,
    CallParser,
    CallStart,
    Text,
    call_grammar,
    call_text,
    history_message,
    plan_tools,
    render_history,
    syntax_for,
)
from meshagent.serving.chat import ChatMessage, ChatTemplate
from meshagent.testing.structured_output import TOOL_SCHEMAS
from meshagent.testing.structured_output import TOOLS as E2E_TOOLS
from tests.engine.test_grammar import walk

TOOLS = E2E_TOOLS
SCHEMAS = TOOL_SCHEMAS


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([{"type": "retrieval"}], None, "tools.0"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools.0.function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": 3}}],
            None,
            "tools.0.function.parameters",
        ),
        (TOOLS + TOOLS[:1], None, "tools"),
        (TOOLS, "sometimes", "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (None, "required", "tool_choice"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(tools, choice, param):
    with pytest.raises(ApiError) as exc:
        plan_tools(tools, choice, None, "")
    assert exc.value.status == 400 and exc.value.param == param


def test_a_plan_follows_tool_choice():
    assert plan_tools(TOOLS, "none", None, "") is None
    assert plan_tools(None, None, None, "") is None
    auto = plan_tools(TOOLS, None, None, "")
    assert auto.choice == "auto" and not auto.forced and auto.parallel
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "add"}}, None, "")
    assert named.choice == "add" and named.forced and not named.parallel


def test_the_syntax_is_the_templates_family():
    assert syntax_for("... [TOOL_CALLS] ...") is MISTRAL
    assert syntax_for("... <|python_tag|> ...") is LLAMA3
    assert syntax_for("{{ tools }} <tool_call>") is HERMES
    assert syntax_for("no tools here") is HERMES


@pytest.mark.parametrize("syntax", [HERMES, MISTRAL, LLAMA3], ids=lambda s: s.name)
@pytest.mark.parametrize("choice", ["required", "add"])
def test_any_walk_through_the_call_grammar_is_a_valid_call(vocab, syntax, choice):
    plan = plan_tools(
        TOOLS,
        choice if choice == "required" else {"type": "function", "function": {"name": choice}},
        None,
        "",
    )
    plan = type(plan)(plan.functions, plan.choice, plan.parallel and syntax.parallel, syntax)
    grammar, trigger = call_grammar(plan)
    assert trigger is None  # forced: from the first token
    for seed in range(2):
        text = walk(vocab, grammar, seed)
        parser = CallParser(syntax)
        parts = parser.feed(text) + parser.finish()
        calls = [p for p in parts if isinstance(p, Call)]
        assert calls and all(isinstance(p, Call) or not p.text.strip() for p in parts), text
        for call in calls:
            assert choice == "required" or call.name == choice
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_auto_grammar_waits_for_the_opening(vocab):
    plan = plan_tools(TOOLS, "auto", None, "")
    grammar, trigger = call_grammar(plan)
    c = vocab.constraint(grammar, trigger)
    for t in vocab.tokenize("Let me check. ", add_bos=False):
        assert c.allows(t)
        c.accept(t)
    for t in vocab.tokenize("<tool_call>\n", add_bos=False):
        c.accept(t)
    assert not c.allows(vocab.tokenize("hello", add_bos=False)[0])  # a call, now
    assert c.allows(vocab.tokenize("{", add_bos=False)[0])


CALLS = [
    ("get_weather", {"city": "Paris", "unit": "celsius", "days": 2}),
    ("add", {"a": 1, "b": -2}),
]


@pytest.mark.parametrize("syntax", [HERMES, MISTRAL], ids=lambda s: s.name)
def test_calls_are_found_in_streamed_text_as_in_the_whole(syntax):
    text = "Checking both. " + call_text(syntax, CALLS)
    whole = CallParser(syntax)
    at_once = whole.feed(text) + whole.finish()
    streamed = CallParser(syntax)
    pieces = [p for ch in text for p in streamed.feed(ch)] + streamed.finish()
    said = "".join(p.text for p in pieces if isinstance(p, Text))
    assert said == "Checking both. " == "".join(p.text for p in at_once if isinstance(p, Text))
    got = [(c.name, json.loads(c.arguments)) for c in pieces if isinstance(c, Call)]
    assert got == CALLS == [(c.name, json.loads(c.arguments)) for c in whole.calls]
    assert len({c.id for c in streamed.calls}) == 2


@pytest.mark.parametrize("syntax", [HERMES, LLAMA3], ids=lambda s: s.name)
def test_a_streamed_calls_arguments_come_as_they_are_written(syntax):
    # Odd spacing and a brace inside a string: the deltas stop exactly where the arguments do.
    args = '{"city": "Par}is" ,"days":[1, {"x": "\\""}]}'
    block = f'{{"name" : "get_weather", "{syntax.args_key}":{args} }}'
    text = "Sure. " + syntax.open + block + syntax.close if syntax.open else block
    p = CallParser(syntax, partial=True)
    parts = [x for ch in text for x in p.feed(ch)] + p.finish()
    starts = [x for x in parts if isinstance(x, CallStart)]
    deltas = [x.text for x in parts if isinstance(x, ArgsDelta)]
    [call] = [x for x in parts if isinstance(x, Call)]
    assert [(s.index, s.id, s.name) for s in starts] == [(0, call.id, "get_weather")]
    assert len(deltas) > 10 and "".join(deltas) == call.arguments == args
    # The start comes before any argument, and the whole call after the last.
    kinds = [type(x).__name__ for x in parts if not isinstance(x, Text)]
    assert kinds[0] == "CallStart" and kinds[-1] == "Call"
    # Without `partial` the same call comes whole, its arguments as written.
    q = CallParser(syntax)
    whole = [x for ch in text for x in q.feed(ch)] + q.finish()
    assert [x.arguments for x in whole if isinstance(x, Call)] == [args]
    assert not any(isinstance(x, CallStart | ArgsDelta) for x in whole)


def test_what_is_not_a_call_stays_text():
    p = CallParser(HERMES)
    # an opening cut off by the end of the output, and JSON that names no function
    assert "".join(x.text for x in p.feed("a <tool_ca") + p.finish()) == "a <tool_ca"
    p = CallParser(HERMES)
    text = '<tool_call>\n{"x": 1}\n</tool_call> and on'
    assert [x.text for x in p.feed(text) + p.finish()] == [
        '<tool_call>\n{"x": 1}\n</tool_call>',
        " and on",
    ]
    p = CallParser(LLAMA3)
    parts = p.feed('{"name": "add", "parameters": {"a": 1, "b": 2}}') + p.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parts] == [("add", {"a": 1, "b": 2})]


def test_a_history_with_calls_and_results_for_a_template_without_tools():
    plan = plan_tools(TOOLS, "auto", None, "")
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
    }
    messages = [
        history_message("user", "add 1 and 2", None, None),
        history_message("assistant", "", [call], None),
        history_message("tool", "3", None, "c1"),
    ]
    assert messages[1].tool_calls[0]["function"]["arguments"] == {"a": 1, "b": 2}
    rendered, extra = render_history(messages, plan, native=False)
    assert (
        extra == {}
        and rendered[0].role == "system"
        and '"name":"get_weather"' in rendered[0].content
    )
    assert rendered[2] == ChatMessage(
        "assistant", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    assert rendered[3] == ChatMessage("user", "<tool_response>\n3\n</tool_response>")


def test_a_template_that_reads_tools_gets_them_and_the_calls_as_objects():
    source = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}"
        "call {{ c.function.name }}({{ c.function.arguments.a }}){% endfor %}"
        "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %};{% endfor %}"
    )
    template = ChatTemplate(source, bos_token="", eos_token="")
    assert template.reads_tools
    plan = plan_tools(TOOLS, "auto", None, source)
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
    }
    messages = [
        history_message("assistant", "", [call], None),
        history_message("tool", "3", None, "c1"),
    ]
    rendered, extra = render_history(messages, plan, native=True)
    assert (
        template.render(rendered, **extra) == "[get_weather][add]assistant:call add(1);tool:3#c1;"
    )
