"""Length-prefixed framing, sans-IO: `length || body`, the length an unsigned integer.

Every protocol that frames messages on a byte stream uses this one rule: `gen/1` and
`artifact/1` (u32, big-endian), `gossip/1` (u32), `stage/1` (u32, little-endian, then a
payload whose size the frame gives) and the relay (u16). A `Framing` holds what differs
between them; `LengthPrefixDecoder` turns received bytes into frame bodies. The trio side
that reads one frame from a stream is `meshagent.net.frame_reader.receive_frame`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from meshagent.wire.errors import FramingError

_WIDTHS = (1, 2, 4, 8)


@dataclass(frozen=True)
class Framing:
    """One protocol's framing: a `width`-byte length in `byteorder`, then that many bytes.
    A receiver refuses a length over `max_size` by raising `error(message)`."""

    what: str  # names a frame in errors: "relay message of 70000 bytes is over ..."
    width: int
    max_size: int
    byteorder: Literal["big", "little"] = "big"
    error: Callable[[str], Exception] = FramingError

    def __post_init__(self) -> None:
        if self.width not in _WIDTHS:
            raise ValueError(f"a length prefix is 1, 2, 4 or 8 bytes, not {self.width}")
        if self.byteorder not in ("big", "little"):
            raise ValueError(f"byteorder must be 'big' or 'little', not {self.byteorder!r}")
        if not 0 <= self.max_size < 1 << (8 * self.width):
            raise ValueError(f"max_size {self.max_size} does not fit a {self.width}-byte length")

    def check(self, size: int) -> None:
        """Raise `error` if a frame body of `size` bytes is over `max_size`."""
        if size > self.max_size:
            raise self.error(f"{self.what} of {size} bytes is over the {self.max_size}-byte limit")

    def encode(self, body: bytes | bytearray | memoryview) -> bytes:
        """`length || body`. `max_size` is the receiver's limit and is not applied here: a
        sender that wants to fail early calls `check` first. OverflowError if the length
        does not fit the prefix."""
        return len(body).to_bytes(self.width, self.byteorder) + body


class LengthPrefixDecoder:
    """Bytes in, frame bodies out. Raises the framing's error as soon as a length over the
    limit is buffered, before any of its body; bytes past the last frame stay buffered."""

    def __init__(self, framing: Framing, data: bytes | bytearray | memoryview = b"") -> None:
        self.framing = framing
        self._buf = bytearray(data)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._buf += data

    def next_frame(self) -> bytes | None:
        """The next frame's body, or None until all of it is buffered."""
        size = self._size()
        if size is None:
            return None
        end = self.framing.width + size
        if len(self._buf) < end:
            return None
        body = bytes(self._buf[self.framing.width : end])
        del self._buf[:end]
        return body

    def take(self, n: int) -> bytes | None:
        """The next `n` bytes as they are, unframed (a payload whose size a frame gave), or
        None until all of them are buffered."""
        if len(self._buf) < n:
            return None
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    @property
    def needed(self) -> int:
        """How many more bytes the next frame needs before `next_frame` returns it (0 when
        it is buffered): lets a reader ask its stream for the rest of a large frame at once."""
        width = self.framing.width
        size = self._size()
        if size is None:
            return width - len(self._buf)
        return max(0, width + size - len(self._buf))

    @property
    def pending(self) -> int:
        """Bytes buffered and not yet returned."""
        return len(self._buf)

    def leftover(self) -> bytes:
        """Everything buffered and not yet returned, and forget it: after the last framed
        message those bytes belong to what the stream carries next (a splice, a body)."""
        out = bytes(self._buf)
        self._buf.clear()
        return out

    def _size(self) -> int | None:
        width = self.framing.width
        if len(self._buf) < width:
            return None
        size = int.from_bytes(self._buf[:width], self.framing.byteorder)
        self.framing.check(size)
        return size
