"""The console's events: each request as it ends reaches every open stream at once, errors are
kept apart, and a stream that stops reading is dropped instead of growing."""

from __future__ import annotations

from meshagent.api import events
from meshagent.api.events import EventHub
from meshagent.api.metrics import Metrics
from meshagent.serving.generation import Finished


def ended(hub: EventHub, status: str = "200", error: str = "") -> None:
    hub.request_ended({"status": status, "error": error, "stages": []})


async def test_every_stream_gets_each_request_and_errors_are_kept():
    hub = EventHub()
    one, two = hub.open(), hub.open()
    ended(hub)
    ended(hub, "503", "the split lost a stage")
    ended(hub, "client_gone")
    for stream in (one, two):
        got = [await stream.receive() for _ in range(3)]
        assert [e["request"]["status"] for e in got] == ["200", "503", "client_gone"]
    assert len(hub.requests) == 3
    assert [e["error"] for e in hub.errors] == ["the split lost a stage"]


async def test_a_closed_stream_is_forgotten_and_a_stalled_one_dropped():
    hub = EventHub()
    closed, stalled, reading = hub.open(), hub.open(), hub.open()
    hub.close(closed)
    for _ in range(events.BACKLOG):
        ended(hub)
        await reading.receive()
    assert hub.streams == 2  # the closed one went at the first event
    ended(hub)  # one more than the stalled stream has room for
    assert hub.streams == 1
    got = [e async for e in stalled]  # what it had, then the end
    assert len(got) == events.BACKLOG
    assert len(hub.requests) == events.KEEP_REQUESTS


def test_a_meter_tells_the_hub_who_served_it_and_how_long_each_stage_took():
    hub = EventHub()
    metrics = Metrics(on_request=hub.request_ended)
    meter = metrics.request()
    meter.model, meter.path = "m", "split"
    meter.receipt([(b"x-meshagent-stages", b"peerA:0-10,peerB:10-20,peerC:20-30")])
    meter.first_text()
    meter.finished(Finished("stop", 9, 5, stage_ms=(4.0, 5.5, 6.25)))
    meter.done(200, client_gone=False)
    [record] = hub.requests
    assert record["status"] == "200" and record["completion_tokens"] == 5
    assert record["stages"] == [
        {"peer": "peerA", "layers": "0-10", "ms": 4.0},
        {"peer": "peerB", "layers": "10-20", "ms": 5.5},
        {"peer": "peerC", "layers": "20-30", "ms": 6.2},
    ]
    failed = metrics.request()
    failed.fail(429, "the queue is full")
    failed.done(429, client_gone=False)
    assert hub.errors[-1]["error"] == "the queue is full"
