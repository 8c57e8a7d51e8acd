"""What the console is told (`GET /control/events`): each request as it ends, kept for a
while with the errors among them, handed to every open events stream at once.

A stream that falls behind (a stalled browser tab) is dropped rather than let its backlog
grow: the console reconnects and starts again from a fresh state."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from meshagent.api.exchange import Exchange

KEEP_REQUESTS = 50  # recent requests a new stream starts with
KEEP_ERRORS = 20
BACKLOG = 256  # events a stream may have unread before it is dropped
STATE_EVERY = 1.0  # seconds between state events


class EventHub:
    def __init__(self) -> None:
        self.requests: deque[dict[str, Any]] = deque(maxlen=KEEP_REQUESTS)
        self.errors: deque[dict[str, Any]] = deque(maxlen=KEEP_ERRORS)
        self._streams: set[trio.MemorySendChannel[dict[str, Any]]] = set()

    def request_ended(self, record: dict[str, Any]) -> None:
        """A request ended (`RequestMeter.record`): keep it and tell every stream."""
        self.requests.append(record)
        if record.get("error") or record.get("status", "200") not in ("200", "client_gone"):
            self.errors.append(record)
        self._tell({"type": "request", "request": record})

    def _tell(self, event: dict[str, Any]) -> None:
        for send in list(self._streams):
            try:
                send.send_nowait(event)
            except trio.WouldBlock:  # it stopped reading: drop it
                self._streams.discard(send)
                send.close()
            except trio.BrokenResourceError:
                self._streams.discard(send)

    def open(self) -> trio.MemoryReceiveChannel[dict[str, Any]]:
        """A stream of events from now on; close the receiver when done."""
        send, receive = trio.open_memory_channel[dict[str, Any]](BACKLOG)
        self._streams.add(send)
        return receive

    def close(self, receive: trio.MemoryReceiveChannel[dict[str, Any]]) -> None:
        receive.close()  # its sender is dropped at the next event (BrokenResourceError)

    @property
    def streams(self) -> int:
        return len(self._streams)


async def serve_events(
    ex: Exchange,
    hub: EventHub,
    state: Callable[[], dict[str, Any]],
    stopping: Callable[[], bool],
) -> None:
    """`GET /control/events` (server-sent events): a `state` event at once, with the recent
    requests and errors, then every `STATE_EVERY` seconds; a `request` event as each request
    ends. Ends when the agent is `stopping` or the stream fell behind."""
    events = hub.open()
    try:
        await ex.start_sse([(b"cache-control", b"no-store")])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ex.watch_disconnect, nursery.cancel_scope)
            first = {"requests": list(hub.requests), "errors": list(hub.errors)}
            await ex.send_event({"type": "state", **state(), **first})
            while not stopping():
                with trio.move_on_after(STATE_EVERY):
                    async for event in events:
                        await ex.send_event(event)
                    break  # the hub dropped this stream: it fell behind
                await ex.send_event({"type": "state", **state()})
            await ex.end()
            nursery.cancel_scope.cancel()
    finally:
        hub.close(events)
