"""Reading one length-prefixed frame from a trio stream: the I/O edge of
`meshagent.wire.framing`, kept here because the wire layer imports no trio."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cbor2
import trio

from meshagent.wire.framing import LengthPrefixDecoder


async def receive_frame(
    stream: trio.abc.ReceiveStream,
    frames: LengthPrefixDecoder,
    *,
    on_eof: Callable[[], BaseException],
    receive_size: int | None = None,
) -> bytes:
    """The next frame's body from `stream`; bytes read past it stay in `frames`. Raises
    `on_eof()` if the stream ends before a whole frame (at a boundary or mid-frame), and the
    framing's error on a length over its limit. Each receive asks for `receive_size` bytes
    or the rest of the frame if more (None: the stream's default)."""
    while (body := frames.next_frame()) is None:
        size = None if receive_size is None else max(receive_size, frames.needed)
        data = await stream.receive_some(size)
        if not data:
            raise on_eof()
        frames.feed(data)
    return body


async def receive_cbor(
    stream: trio.abc.ReceiveStream,
    frames: LengthPrefixDecoder,
    *,
    version: int,
    on_eof: Callable[[], BaseException],
    error: Callable[[str], BaseException],
    what: str,
    receive_size: int | None = None,
) -> dict[int, Any]:
    """The next frame as a CBOR map whose key 0 is `version`: `error(...)` when it is not
    CBOR, not a map or of another version (`what` names it in the message)."""
    body = await receive_frame(stream, frames, on_eof=on_eof, receive_size=receive_size)
    try:
        msg = cbor2.loads(body)
    except (cbor2.CBORDecodeError, ValueError) as e:
        raise error(f"malformed {what}: {e}") from e
    if not isinstance(msg, dict) or msg.get(0) != version:
        raise error(f"{what} of an unknown version or shape")
    return msg
