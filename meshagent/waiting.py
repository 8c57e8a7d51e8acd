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
