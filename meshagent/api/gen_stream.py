"""`gen/1` messages on an overlay stream: the next one read (or why the stream is `Broken`), and
one sent to a peer that may be gone already. Both sides of the protocol use these: the asker
(`api/carried.py`, `api/elsewhere.py`) and the entry (`api/entry.py`)."""

from __future__ import annotations

import contextlib

import trio

from meshagent.api.gen_messages import FRAMING, GenMessageError, Message, decode, encode
from meshagent.errors import MeshError
from meshagent.net.frame_reader import receive_frame
from meshagent.wire.framing import LengthPrefixDecoder


class Broken(MeshError):
    """The stream to the peer broke or carried something that is not a message."""


def frames() -> LengthPrefixDecoder:
    """A reader of one stream's messages."""
    return LengthPrefixDecoder(FRAMING)


async def read_message(stream: trio.abc.ReceiveStream, reader: LengthPrefixDecoder) -> Message:
    """The next message on `stream`; `Broken` saying why there is none."""
    try:
        body = await receive_frame(
            stream, reader, on_eof=lambda: Broken("the peer ended the stream mid-generation")
        )
    except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
        raise Broken(str(e)) from e
    except MeshError as e:  # the framing's limit
        raise Broken(str(e)) from e
    try:
        return decode(body)
    except GenMessageError as e:
        raise Broken(str(e)) from e


async def send_quietly(stream: trio.abc.SendStream, msg: Message) -> None:
    """Send `msg` unless the stream is gone (its peer left: nothing to tell)."""
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await stream.send_all(encode(msg))
