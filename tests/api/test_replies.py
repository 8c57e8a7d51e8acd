"""Reply shapes without a model: n choices stream under their own index, calls come out of
a choice's text whole or streamed, and logprobs ride with the text they belong to."""

from __future__ import annotations

import json

from meshagent.api.replies import Output, Reply, merged
from meshagent.api.tools import HERMES, Call, Text, call_text
from meshagent.serving.generation import Delta, Finished, Logprob

CALL = call_text(HERMES, [("add", {"a": 1, "b": 2})])


def test_n_choices_stream_under_their_index_and_usage_counts_the_prompt_once():
    reply = Reply(chat=True, model="m", n=2)
    assert [c["choices"][0]["index"] for c in reply.opening()] == [0, 1]
    chunk = reply.delta_chunks(Delta("hi"), 1)[0]
    assert chunk["choices"][0] == {
        "index": 1,
        "delta": {"content": "hi"},
        "logprobs": None,
        "finish_reason": None,
    }
    ends = [Finished("stop", 10, 3, cached_tokens=9), Finished("length", 10, 5, cached_tokens=0)]
    assert (merged(ends).completion_tokens, merged(ends).cached_tokens) == (8, 0)
    body = reply.whole("", [[Delta("a")], [Delta("b")]], ends)
    assert [c["message"]["content"] for c in body["choices"]] == ["a", "b"]
    assert body["usage"]["total_tokens"] == 18


def test_a_call_in_the_text_becomes_tool_calls_whole_and_streamed():
    whole = Reply(chat=True, model="m", tools=HERMES).whole(
        "", [[Delta("Sure. "), Delta(CALL)]], [Finished("stop", 5, 9)]
    )
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Sure."
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 1, "b": 2}
    reply = Reply(chat=True, model="m", tools=HERMES)
    chunks = [c for ch in CALL for c in reply.delta_chunks(Delta(ch))]
    chunks += reply.end_chunks("stop")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    # Its name first, then its arguments as they are written, which join into the call's.
    first = calls[0][0]
    assert first["id"].startswith("call_") and first["function"] == {"name": "add", "arguments": ""}
    assert len(calls) > 3 and all(c[0]["index"] == 0 for c in calls)
    assert json.loads("".join(c[0]["function"]["arguments"] for c in calls)) == {"a": 1, "b": 2}
    assert not any(d.get("content") for d in deltas)  # the call's text is not content
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_logprobs_of_text_held_back_come_with_it():
    reply = Reply(chat=True, model="m", logprobs=True, tools=HERMES)
    lp = Logprob(b"<", -0.5, ((b"<", -0.5),))
    assert reply.delta_chunks(Delta("<", (5,), (lp,))) == []  # may open a call: held
    [chunk] = reply.delta_chunks(Delta("x", (6,), (Logprob(b"x", -1.0),)))
    content = chunk["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["<", "x"] and chunk["choices"][0]["delta"] == {
        "content": "<x"
    }


def test_completion_logprobs_count_offsets_across_chunks():
    reply = Reply(chat=False, model="m", logprobs=True)
    a = reply.chunk("ab", logprobs=(Logprob(b"a", -1.0), Logprob(b"b", -2.0, ((b"b", -2.0),))))
    b = reply.chunk("c", logprobs=(Logprob(b"c", -3.0),))
    assert a["choices"][0]["logprobs"]["text_offset"] == [0, 1]
    assert b["choices"][0]["logprobs"]["text_offset"] == [2]
    assert a["choices"][0]["logprobs"]["top_logprobs"][1] == {"b": -2.0}


def test_an_output_parses_calls_out_of_the_text_and_drops_the_blank_text_between_them():
    one, two = (call_text(HERMES, [("add", {"a": a})]) for a in (1, 2))
    output = Output(HERMES)
    parts = [p for ch in "Sure. " + one + " \n" + two + "  " for p in output.feed(ch)]
    held, reason = output.end("stop")
    parts += held
    calls = [i for i, p in enumerate(parts) if isinstance(p, Call)]
    assert calls == [len(parts) - 2, len(parts) - 1]  # no text after the first call
    assert "".join(p.text for p in parts if isinstance(p, Text)) == "Sure. "
    assert [json.loads(p.arguments) for p in parts if isinstance(p, Call)] == [{"a": 1}, {"a": 2}]
    assert reason == "tool_calls"
    assert Output(HERMES).end("length")[1] == "length"


def test_an_output_without_tools_is_the_text_as_it_comes():
    output = Output(None)
    assert output.feed("<tool_call>") == [Text("<tool_call>")]
    assert output.end("stop") == ([], "stop")
