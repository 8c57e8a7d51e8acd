"""The control channel between the harness and the emulator process.

A Unix stream socket pair, created by the harness; the emulator gets one end as an inherited
file descriptor. Each message is a 4-byte big-endian length and a JSON object; every request
gets exactly one reply, `{"ok": true, ...}` or `{"ok": false, "error": "..."}`. When the
harness's end closes (the harness exited, however it exited) the emulator sees end of file and
stops, so it never outlives the lab that started it.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from typing import Any

from netsim.errors import EmulatorError

_LEN = struct.Struct(">I")
MAX_MESSAGE = 64 << 20


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv_message(sock: socket.socket) -> dict[str, Any] | None:
    """The next message, or None at end of file."""
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > MAX_MESSAGE:
        raise EmulatorError(f"control message of {n} bytes is over the {MAX_MESSAGE} limit")
    body = _recv_exact(sock, n)
    if body is None:
        return None
    return json.loads(body)


class ControlClient:
    """The harness's end: `request(op, **args)` returns the reply's fields or raises
    `EmulatorError`. Safe to call from several threads."""

    def __init__(self, sock: socket.socket, timeout: float = 30.0) -> None:
        self._sock = sock
        self._sock.settimeout(timeout)
        self._lock = threading.Lock()

    def request(self, op: str, **args: Any) -> dict[str, Any]:
        with self._lock:
            try:
                send_message(self._sock, {"op": op, **args})
                reply = recv_message(self._sock)
            except OSError as e:
                raise EmulatorError(f"emulator control channel failed during {op!r}: {e}") from e
        if reply is None:
            raise EmulatorError(f"the emulator closed its control channel during {op!r}")
        if not reply.get("ok"):
            raise EmulatorError(f"emulator refused {op!r}: {reply.get('error')}")
        return reply

    def close(self) -> None:
        self._sock.close()
