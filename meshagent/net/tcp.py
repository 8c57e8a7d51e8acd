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
    try:
        _bind_as_listener(infos)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise _in_use(address, advice) from e
        raise ConfigError(f"cannot listen on {address}: {e.strerror or e}") from e


def _bind_as_listener(infos: list) -> None:
    """Bind each of `infos` as a listener that shares its port with nobody would, and let go:
    OSError (EADDRINUSE) where something listens there already."""
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(sockaddr)


def _share_port(sock: trio.socket.SocketType) -> None:
    """Several sockets on one port: the listener, and connections dialed from it."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)


class TcpTransport(Transport):
    """Listeners share their port (SO_REUSEPORT) so that `dial_from` can connect from it."""

    async def dial(self, address: Address) -> trio.abc.Stream:
        return await trio.open_tcp_stream(address.host, address.port)

    async def dial_from(self, address: Address, local: Address) -> trio.abc.Stream:
        infos = await trio.socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM)
        if not infos:
            raise OSError(f"no address for {address.host}")
        family, kind, proto, _, sockaddr = infos[0]
        host = local.host
        if host in ("", "0.0.0.0", "::"):
            host = "::" if family == socket.AF_INET6 else "0.0.0.0"
        sock = trio.socket.socket(family, kind, proto)
        try:
            _share_port(sock)
            await sock.bind((host, local.port))
            await sock.connect(sockaddr)
        except BaseException:
            sock.close()
            raise
        return trio.SocketStream(sock)

    async def serve(
        self,
        address: Address,
        handler: StreamHandler,
        *,
        task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        try:
            listeners = await _listeners(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise _in_use(address) from e
            raise
        host, port = listeners[0].socket.getsockname()[:2]
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(trio.serve_listeners, handler, listeners))
            task_status.started(Address(host, port))


async def _listeners(address: Address) -> list[trio.SocketListener]:
    """As `trio.open_tcp_listeners`, with the port shared (`_share_port`). Port 0 picks one
    free port for every family."""
    host = address.host or None
    infos = await trio.socket.getaddrinfo(
        host, address.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    if address.port:
        # Sharing the port must not let a second agent listen beside the first.
        _bind_as_listener(infos)
    listeners: list[trio.SocketListener] = []
    port = address.port
    try:
        for family, kind, proto, _, sockaddr in infos:
            sock = trio.socket.socket(family, kind, proto)
            try:
                _share_port(sock)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                await sock.bind((sockaddr[0], port, *sockaddr[2:]))
                port = sock.getsockname()[1]
                sock.listen(socket.SOMAXCONN)
            except BaseException:
                sock.close()
                raise
            listeners.append(trio.SocketListener(sock))
    except BaseException:
        for listener in listeners:
            listener.socket.close()
        raise
    return listeners
