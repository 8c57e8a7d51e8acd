"""Waiting on several things at once, as the services do (trio)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio


async def first(*waits: Callable[[], Awaitable[object]]) -> None:
    """Until the first of `waits` returns (the others are cancelled)."""
    async with trio.open_nursery() as nursery:
        for wait in waits:

            async def one(wait: Callable[[], Awaitable[object]] = wait) -> None:
                await wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(one)


class Generation:
    """A count of changes that tasks wait on: `bump()` on each change; `wait_past(n)` returns
    once the count passes `n`, so a loop of `n = await g.wait_past(n)` misses none."""

    def __init__(self) -> None:
        self.value = 0
        self._event = trio.Event()

    def bump(self) -> None:
        self.value += 1
        self._event.set()
        self._event = trio.Event()

    async def wait_past(self, after: int) -> int:
        while self.value <= after:
            await self._event.wait()
        return self.value
