"""Real TCP transport on trio sockets."""

from __future__ import annotations

import errno
import socket
from functools import partial

import trio

from meshagent.errors import ConfigError
from meshagent.net.address import Address
from meshagent.net.transport import StreamHandler, Transport


def _in_use(address: Address, advice: str = "") -> ConfigError:
    return ConfigError(
        f"{address} is already in use: another agent or program listens there."
        + (f" {advice}" if advice else "")
    )


def check_listenable(address: Address, *, advice: str = "") -> None:
    """Raise ConfigError now if `address` cannot be listened on (e.g. another process listens
    there), by binding it as a listener would and letting go at once; an agent checks this
    before the slow parts of its start. `advice` ends the message when the address is taken."""
    host = address.host or None  # as trio.open_tcp_listeners resolves it
    try:
        infos = socket.getaddrinfo(
            host, address.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise ConfigError(f"cannot listen on {address}: {e.strerror or e}") from e
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(sockaddr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise _in_use(address, advice) from e
                raise ConfigError(f"cannot listen on {address}: {e.strerror or e}") from e


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
        try:
            listeners = await trio.open_tcp_listeners(address.port, host=address.host)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise _in_use(address) from e
            raise
        host, port = listeners[0].socket.getsockname()[:2]
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(trio.serve_listeners, handler, listeners))
            task_status.started(Address(host, port))
