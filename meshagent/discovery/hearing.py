"""Asking another peer whether it still hears a third (`hear/1`).

When this agent's connection to a peer goes silent, the silence alone cannot say whether the
peer is gone (a power cut) or only the path between the two is (a partition): the others can.
The asker opens a stream labelled `hear/1:<peer id>` to each other connected peer and
half-closes it at once (it has nothing more to say); each answers with how long its own
connection to that peer has gone without a PONG, in milliseconds (u32, big-endian;
`NO_LINK` when it has no connection to it), and half-closes. Any four bytes are an answer;
anything else is a `HearingError`, and the asker counts no answer from that peer.
"""

from __future__ import annotations

import math
import struct

import trio

from meshagent.errors import MeshError
from meshagent.net.errors import ConnectionUnavailable
from meshagent.net.manager import ConnectionManager
from meshagent.net.stream import MeshStream

LABEL = "hear/1"
NO_LINK = 0xFFFFFFFF
_REPLY = struct.Struct(">I")
_MAX_ID = 128


class HearingError(MeshError):
    """A `hear/1` answer that is not one; the message says how."""


def reply(silent_s: float | None) -> bytes:
    """The answer: milliseconds without a PONG (0 up to `NO_LINK` - 1, whatever the clock
    says), or `NO_LINK` for None."""
    if silent_s is None:
        return _REPLY.pack(NO_LINK)
    ms = silent_s * 1000 if not math.isnan(silent_s) else 0.0
    return _REPLY.pack(int(min(max(ms, 0.0), NO_LINK - 1)))


def parse(data: bytes) -> float | None:
    """Seconds from an answer, None for `NO_LINK`; HearingError if it is not one."""
    if len(data) != _REPLY.size:
        raise HearingError(f"a hear/1 answer is {_REPLY.size} bytes, not {len(data)}")
    (ms,) = _REPLY.unpack(data)
    return None if ms == NO_LINK else ms / 1000


async def serve(overlay: ConnectionManager, stream: MeshStream) -> None:
    """Answer for the peer named after the label's colon."""
    about = stream.label.partition(":")[2]
    if not about or len(about) > _MAX_ID:
        stream.reset("hear/1 needs the peer id after the label's colon")
        return
    while await stream.receive_some():  # nothing is expected before the asker's EOF
        stream.reset("hear/1 carries no request body")
        return
    conn = overlay.connection(about)
    await stream.send_all(reply(None if conn is None else conn.silent_for()))
    await stream.send_eof()


async def ask(overlay: ConnectionManager, peer_id: str, about: str, timeout: float) -> float | None:
    """How long `peer_id` has not heard from `about`, in seconds; None when it has no
    connection to it, or did not answer within `timeout`."""
    with trio.move_on_after(timeout):
        try:
            stream = await overlay.open_stream(peer_id, f"{LABEL}:{about}")
            try:
                await stream.send_eof()
                data = b""
                while len(data) < _REPLY.size and (chunk := await stream.receive_some()):
                    data += chunk
                return parse(bytes(data))
            finally:
                await stream.aclose()
        except (ConnectionUnavailable, OSError, HearingError, trio.BrokenResourceError):
            return None  # no connection, a reset stream, a malformed answer: no answer
    return None
