"""Sockets that live in another network namespace, opened from the harness's own process.

A network namespace is a property of each thread (`setns(2)`), and a socket stays in the
namespace it was created in. So the harness enters a host's namespace for the instant it takes
to create a socket, returns to its own, and then talks to `127.0.0.1` inside the host (an
agent's API) as if it ran there, without starting a process per request.
"""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import socket
from typing import Any

CLONE_NEWNET = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int, what: str) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns({what}): {os.strerror(err)}")


def socket_in(netns_path: str, family: int = socket.AF_INET, kind: int = socket.SOCK_STREAM):
    """A new socket in the network namespace at `netns_path`; the calling thread stays in its
    own namespace."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(netns_path, os.O_RDONLY)
    try:
        _setns(target, netns_path)
        try:
            return socket.socket(family, kind)
        finally:
            _setns(home, "back to the harness's namespace")
    finally:
        os.close(target)
        os.close(home)


def connect_in(netns_path: str, address: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to `address:port` as seen from inside the namespace."""
    sock = socket_in(netns_path)
    try:
        sock.settimeout(timeout)
        sock.connect((address, port))
    except OSError:
        sock.close()
        raise
    return sock


class NamespaceHTTPConnection(http.client.HTTPConnection):
    """`http.client` over a socket in another namespace."""

    def __init__(self, netns_path: str, host: str, port: int, timeout: float = 10.0) -> None:
        super().__init__(host, port, timeout=timeout)
        self.netns_path = netns_path

    def connect(self) -> None:
        self.sock = connect_in(self.netns_path, self.host, self.port, self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def get_json(netns_path: str, port: int, path: str, *, timeout: float = 10.0) -> Any:
    """GET `http://127.0.0.1:<port><path>` inside the namespace and decode the JSON body;
    OSError (refused, timed out) or ValueError (not JSON, or not a 200) if it fails."""
    conn = NamespaceHTTPConnection(netns_path, "127.0.0.1", port, timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read()
    except http.client.HTTPException as e:
        raise OSError(f"GET {path}: {e}") from e
    finally:
        conn.close()
    if r.status != 200:
        raise ValueError(f"GET {path}: HTTP {r.status}: {body[:200]!r}")
    return json.loads(body)
