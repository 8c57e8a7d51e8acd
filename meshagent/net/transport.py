"""The network interface the overlay runs on: real TCP in production, simulated in tests."""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable

import trio

from meshagent.net.address import Address

StreamHandler = Callable[[trio.abc.Stream], Awaitable[None]]


class Transport(abc.ABC):
    """Reliable, ordered byte streams between addresses. No security: the overlay adds it."""

    @abc.abstractmethod
    async def dial(self, address: Address) -> trio.abc.Stream:
        """Open a byte stream to `address`; raises OSError when nothing answers."""

    async def dial_from(self, address: Address, local: Address) -> trio.abc.Stream:
        """Open a byte stream to `address` from the local address `local` (the port we listen
        on: a NAT then maps it as it maps that port, and a hole punched from it lets the other
        side in). Transports without local addresses dial as `dial` does."""
        return await self.dial(address)

    @abc.abstractmethod
    async def serve(
        self,
        address: Address,
        handler: StreamHandler,
        *,
        task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept streams on `address` until cancelled, running `handler` on each in a task
        owned by this call. Reports the bound address (port 0 picks one) via task_status."""

    @staticmethod
    def remote_of(stream: trio.abc.Stream) -> str:
        """Best-effort printable remote end of a stream, for logs."""
        remote = getattr(stream, "remote", None)
        if remote is not None:
            return str(remote)
        sock = getattr(stream, "socket", None)
        if sock is not None:
            try:
                host, port = sock.getpeername()[:2]
                return str(Address(host, port))
            except OSError:
                return "?"
        return "?"
