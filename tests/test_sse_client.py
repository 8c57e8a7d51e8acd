import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshagent.sse_client import (
    Event,
    EventDecoder,
    StreamIncomplete,
    aiter_events,
    chunk_text,
    completion_text,
    iter_events,
)

STREAM = (
    b": keep-alive\n"
    b'data: {"choices": [{"text": "a"}]}\n'
    b"\n"
    b"event: note\n"
    b"id: 7\n"
    b"data: one\n"
    b"data:two\n"
    b"\n"
    b"event: empty\n"  # no data: no event
    b"\n"
    b"data\n"  # a field without a colon: an empty data line
    b"\n"
    b"data: [DONE]\n"
    b"\n"
)
EVENTS = [
    Event('{"choices": [{"text": "a"}]}'),
    Event("one\ntwo", "note", "7"),
    Event("", "message", "7"),
    Event("[DONE]", "message", "7"),
]


def _lines(stream: bytes) -> list[str]:
    return stream.decode().split("\n")


def test_lines_give_each_event_at_its_blank_line():
    decoder = EventDecoder()
    assert [e for line in _lines(STREAM) if (e := decoder.line(line))] == EVENTS
    assert EVENTS[0].json() == {"choices": [{"text": "a"}]}
    assert EVENTS[-1].done and not EVENTS[0].done


def test_an_event_the_stream_does_not_end_is_not_given():
    decoder = EventDecoder()
    assert decoder.feed(b"data: 1\n\ndata: cut") == [Event("1")]
    assert decoder.feed(b"\n") == []


def test_bytes_cut_anywhere_give_the_same_events():
    for at in range(len(STREAM) + 1):
        decoder = EventDecoder()
        assert decoder.feed(STREAM[:at]) + decoder.feed(STREAM[at:]) == EVENTS, at


def test_any_line_ending_and_a_character_cut_between_chunks():
    text = "data: é\r\n\r\ndata: ü\r\rdata: ñ\n\n".encode()
    want = [Event("é"), Event("ü"), Event("ñ")]
    decoder = EventDecoder()
    assert [e for byte in text for e in decoder.feed(bytes([byte]))] == want


@given(st.lists(st.text(st.characters(blacklist_categories=["Cs", "Cc"])), max_size=5), st.data())
def test_any_data_in_any_chunks(values, draw):
    stream = "".join(f"data: {v}\n\n" for v in values).encode()
    cuts = sorted(draw.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    decoder = EventDecoder()
    got = []
    for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        got += decoder.feed(stream[a:b])
    assert got == [Event(v) for v in values]


def test_the_events_of_a_streaming_response():
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=STREAM))
    with (
        httpx.Client(transport=transport) as client,
        client.stream("GET", "http://agent/") as r,
    ):
        assert list(iter_events(r)) == EVENTS


async def test_the_events_of_an_async_streaming_response():
    async def chunks():
        for i in range(0, len(STREAM), 5):
            yield STREAM[i : i + 5]

    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=chunks()))
    async with (
        httpx.AsyncClient(transport=transport) as client,
        client.stream("GET", "http://agent/") as r,
    ):
        assert [e async for e in aiter_events(r)] == EVENTS


def test_the_text_a_chunk_adds_chat_or_completion():
    assert chunk_text({"choices": [{"delta": {"content": "Hi"}}]}) == "Hi"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert chunk_text({"choices": [{"text": " there", "finish_reason": None}]}) == " there"
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 2}}) == ""


def _events(*chunks: str) -> list[Event]:
    return [Event(c) for c in chunks]


def test_the_text_of_a_whole_stream_and_of_one_cut_short():
    whole = _events('{"choices": [{"text": "a"}]}', '{"choices": [{"text": "b"}]}', "[DONE]")
    assert completion_text(whole) == "ab"
    with pytest.raises(StreamIncomplete, match="without"):
        completion_text(whole[:-1])
    with pytest.raises(StreamIncomplete, match="overloaded"):
        completion_text(_events('{"choices": [{"text": "a"}]}', '{"error": "overloaded"}'))
