"""Outbox: sends to one stream, in order, from code on the event loop that cannot wait.

A worker thread that finishes a piece of work posts its bytes to the event loop
(`run_sync_soon`); a callback cannot await `send_all`. `Outbox.put` sends what the stream
takes at once (a `MeshStream` whose peer has granted credit, and whose socket has room: no
task switch at all) and leaves the rest to a task it starts in `nursery`, which sends it in
order with `send_all`. Streams without `send_nowait` always go through that task.

Memory is bounded by the caller: it puts only what its own bounded pipeline produced.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import trio

_SEND_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


class Outbox:
    def __init__(
        self,
        stream: trio.abc.SendStream,
        nursery: trio.Nursery,
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.stream = stream
        self._nursery = nursery
        self._on_error = on_error
        self._backlog: deque[bytes | memoryview] = deque()
        self._draining = False
        self._drained = trio.Event()
        self.failed: BaseException | None = None

    def put(self, data: bytes) -> None:
        """Send `data` after everything put before it. Never blocks; a failure goes to
        `on_error` (once) and later puts are dropped."""
        if self.failed is not None or not data:
            return
        if not self._backlog and not self._draining:
            send_nowait = getattr(self.stream, "send_nowait", None)
            if send_nowait is not None:
                try:
                    n = send_nowait(data)
                except _SEND_ERRORS as e:
                    self._fail(e)
                    return
                if n == len(data):
                    return
                data = memoryview(data)[n:]
        self._backlog.append(data)
        if not self._draining:
            self._draining = True
            self._drained = trio.Event()
            self._nursery.start_soon(self._drain)

    async def _drain(self) -> None:
        try:
            while self._backlog and self.failed is None:
                await self.stream.send_all(self._backlog[0])
                self._backlog.popleft()
        except _SEND_ERRORS as e:
            self._fail(e)
        finally:
            self._draining = False
            self._drained.set()

    async def flush(self) -> None:
        """Wait until everything put so far has been handed to the stream (or failed)."""
        while self._draining:
            await self._drained.wait()

    def close(self) -> None:
        """Put no more (the nursery is closing): later puts are dropped."""
        if self.failed is None:
            self.failed = trio.ClosedResourceError("the outbox was closed")
            self._backlog.clear()

    def _fail(self, error: BaseException) -> None:
        if self.failed is None:
            self.failed = error
            self._backlog.clear()
            self._on_error(error)
