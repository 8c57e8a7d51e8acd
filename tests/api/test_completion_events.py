"""A completion's events as its protocol module reads them: the meter hears of the receipt,
the first text, the end of all n choices (usage counted once) and a failure."""

from __future__ import annotations

import math

import pytest
import trio

from meshagent.api.completion_events import Choice, Completion, Event, Failed, Opened
from meshagent.api.errors import ApiError
from meshagent.api.metrics import Metrics
from meshagent.serving.generation import Delta, Finished

RECEIPT = [(b"x-meshagent-stages", b"p:0-30")]


def opened(n: int) -> Opened:
    return Opened(True, "m", n, True, False, False, "", None, RECEIPT)


def completion(events: list[Event]) -> tuple[Completion, list[dict]]:
    records: list[dict] = []
    meter = Metrics(on_request=records.append).request()
    send, receive = trio.open_memory_channel[Event](math.inf)
    for ev in events:
        send.send_nowait(ev)
    send.close()
    return Completion(receive, meter), records


async def test_the_meter_counts_n_choices_once_all_have_ended():
    ends = [Finished("stop", 10, 3), Finished("length", 10, 5)]
    events = [opened(2), Choice(1, Delta("a")), Choice(0, ends[0]), Choice(1, ends[1])]
    c, records = completion(events)
    assert await c.opened() == events[0]
    got = [ev async for ev in c]
    assert got == events[1:]
    c._meter.done(200, client_gone=False)
    [record] = records
    assert record["stages"] == [{"peer": "p", "layers": "0-30", "ms": None}]
    assert (record["prompt_tokens"], record["completion_tokens"]) == (10, 8)
    assert record["ttft_ms"] is not None and record["status"] == "200"


@pytest.mark.parametrize("first", [True, False], ids=["before-opened", "after"])
async def test_a_failure_is_the_meters_status(first):
    failed = Failed(ApiError(429, "the queue is full"))
    c, records = completion([failed] if first else [opened(1), failed])
    if first:
        assert await c.opened() == failed
    else:
        await c.opened()
        assert [ev async for ev in c] == [failed]
    c._meter.done(200, client_gone=False)
    assert records[0]["status"] == "429" and records[0]["error"] == "the queue is full"
