"""Budgets of inbound streams by service: how many streams of one label one peer may hold
open here at once.

The multiplexer bounds the streams a peer holds open on one connection (its `max_streams`,
256 by default) whatever their labels; this bounds each service's share per peer (all its
connections together), so that a member flooding one label (`gossip/1`, `probe/1`, ...)
neither ties up that service nor leaves no room on the connection for the others. A stream
past its budget is reset with REFUSED_STREAM (safe to retry later) and a logged reason; the
peer's other streams, and everyone else's, go on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Mapping

import structlog

from meshagent.net.stream import MeshStream
from meshagent.wire.errors import ErrorCode

log = structlog.get_logger(__name__)


class StreamBudgets:
    """Counts the inbound streams each peer holds open per service, against `limits`
    (service label -> streams; a label not named has no budget here)."""

    def __init__(self, limits: Mapping[str, int]) -> None:
        if any(n < 1 for n in limits.values()):
            raise ValueError("a stream budget is at least 1")
        self.limits = dict(limits)
        self._open: Counter[tuple[str, str]] = Counter()
        self.refused: Counter[str] = Counter()  # streams refused, by service

    def open_streams(self, peer_id: str, service: str) -> int:
        return self._open[peer_id, service]

    def admit(
        self,
        stream: MeshStream,
        service: str,
        handler: Callable[[MeshStream], Awaitable[None]],
    ) -> Awaitable[None]:
        """Decide at once, as the stream arrives, whether its peer is within the service's
        budget: the work to await is `handler` on `stream` (the stream counted until it
        ends), or nothing once the stream is refused. Counted at arrival, so of streams that
        arrive together the first ones are served, whatever order their tasks then run in."""
        limit = self.limits.get(service)
        if limit is None:
            return handler(stream)
        key = (stream.peer_id, service)
        held = self._open[key]
        if held >= limit:
            reason = (
                f"over budget: this peer holds {held} {service} streams open here, the most "
                "it may; retry once one ends"
            )
            self.refused[service] += 1
            log.warning("stream.refused", peer=stream.peer_id, label=stream.label, reason=reason)
            stream.reset(reason, ErrorCode.REFUSED_STREAM)
            return _nothing()
        self._open[key] = held + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._open[key] -= 1
                if not self._open[key]:
                    del self._open[key]

        # Freed as the stream ends here, before the peer can see it end (so a peer that
        # opens the next one straight after is within budget), or when the handler returns.
        stream.when_ended(release)
        return _counted(stream, handler, release)


async def _counted(
    stream: MeshStream,
    handler: Callable[[MeshStream], Awaitable[None]],
    release: Callable[[], None],
) -> None:
    try:
        await handler(stream)
    finally:
        release()


async def _nothing() -> None:
    pass
