"""Requests in flight, so that shutdown can let them finish within a grace period."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import structlog
import trio

log = structlog.get_logger(__name__)

# After the grace expires, stopped requests get this long to write their final error event.
_FAREWELL = 2.0


class InFlight:
    def __init__(self) -> None:
        self._scopes: set[trio.CancelScope] = set()
        self._changed = trio.Event()
        self.draining = False
        self.expired = False

    def __len__(self) -> int:
        return len(self._scopes)

    @contextmanager
    def track(self) -> Iterator[trio.CancelScope]:
        """A cancel scope for one request; cancelled if it outlives the shutdown grace."""
        scope = trio.CancelScope()
        if self.expired:
            scope.cancel()
        self._scopes.add(scope)
        try:
            yield scope
        finally:
            self._scopes.discard(scope)
            self._changed.set()

    async def _wait_empty(self) -> None:
        while self._scopes:
            self._changed = trio.Event()
            await self._changed.wait()

    async def drain(self, grace: float) -> int:
        """Wait up to `grace` seconds for in-flight requests; stop the rest. Returns how many
        had to be stopped."""
        self.draining = True
        log.info("shutdown.draining", in_flight=len(self._scopes), grace_s=grace)
        with trio.move_on_after(grace):
            await self._wait_empty()
        stopped = len(self._scopes)
        if stopped:
            log.warning("shutdown.grace_expired", stopping=stopped)
            self.expire_now()
            with trio.move_on_after(_FAREWELL):
                await self._wait_empty()
        return stopped

    def expire_now(self) -> None:
        """Stop every request in flight now; each ends with a clear error."""
        self.expired = True
        for scope in list(self._scopes):
            scope.cancel()
