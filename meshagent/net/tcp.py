"""Real TCP transport on trio sockets."""

from __future__ import annotations

from functools import partial

import trio

from meshagent.net.address import Address
from meshagent.net.transport import StreamHandler, Transport


class TcpTransport(Transport):
    async def dial(self, address: Address) -> trio.abc.Stream:
        return await trio.open_tcp_stream(address.host, address.port)

    async def serve(
        self,
        address: Address,
        handler: StreamHandler,
        *,
        task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        listeners = await trio.open_tcp_listeners(address.port, host=address.host)
        host, port = listeners[0].socket.getsockname()[:2]
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(trio.serve_listeners, handler, listeners))
            task_status.started(Address(host, port))
