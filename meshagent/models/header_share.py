"""Telling a peer where a model file's tokenizer lies in its header (`header/1`), so that a
stage host starting on a hub name fetches the header around it (`ranged.HeaderMap`).

An agent that has read the whole header of its model answers a request naming the file's
sha256 with the header's end and the gaps: the byte spans of its `tokenizer.*` entries and how
many entries each holds. A new agent asks the peers it was told of (`--join`, `--peer`) before
it fetches anything from the hub, with a throwaway identity (the agent itself is not up yet).
Nothing is trusted that the hub's bytes do not confirm: the header fetched around the gaps
must read through them and end where the map says (`PartialModel._fetch_mapped`), else it is
fetched whole.

One stream per question, each way one message framed `u32 length | cbor map`:
request {0: version, 1: sha256}; answer {0: version, 2: end, 3: [[start, end, count], ...]} or
{0: version, 4: why not}.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import cbor2
import numpy as np
import structlog
import trio

from meshagent.errors import MeshError
from meshagent.models.gguf_file import parse_header
from meshagent.models.header_map import HeaderMap, header_map
from meshagent.models.ranged import MAX_HEADER, PartialModel, is_partial
from meshagent.net.frame_reader import receive_cbor
from meshagent.wire.framing import Framing, LengthPrefixDecoder
from meshagent.wire.quoted import quoted

log = structlog.get_logger(__name__)

LABEL = "header/1"
VERSION = 1
MAX_MESSAGE = 64 * 1024
MAX_GAPS = 64
ASK_TIMEOUT = 5.0  # seconds for the peers to answer, connections included
K_VERSION, K_SHA256, K_END, K_GAPS, K_ERROR = range(5)


class HeaderShareError(MeshError):
    pass


FRAMING = Framing("header map message", width=4, max_size=MAX_MESSAGE, error=HeaderShareError)
Sha256Of = Callable[[], str]  # the agent's model file's sha256 (blocking: may hash it)


def _encode(fields: dict[int, Any]) -> bytes:
    return FRAMING.encode(cbor2.dumps({K_VERSION: VERSION, **fields}))


async def _read(stream: trio.abc.ReceiveStream) -> dict[int, Any]:
    def ended() -> HeaderShareError:
        return HeaderShareError("the peer ended the stream early")

    frames = LengthPrefixDecoder(FRAMING)
    return await receive_cbor(
        stream, frames, version=VERSION, on_eof=ended, error=HeaderShareError, what="header map"
    )


def map_of(path: Path, sha256: str) -> HeaderMap | None:
    """The map of the model file at `path` (whose sha256 is `sha256`), or None where its
    header is not whole here (a partial copy fetched around its tokenizer, or not begun)."""
    if is_partial(path):
        part = PartialModel(path)
        if part.gaps or part.header_bytes <= 0:
            return None
        with path.open("rb") as f:
            head = f.read(part.header_bytes)
        return header_map(parse_header(head), sha256)
    return header_map(parse_header(memoryview(np.memmap(path, mode="r"))), sha256)


class HeaderMapServer:
    """Answers `header/1` for the model files `files()` gives, each with its sha256."""

    def __init__(self, files: Callable[[], Sequence[tuple[Path, Sha256Of]]]) -> None:
        self.files = files
        self._made: HeaderMap | None = None

    @classmethod
    def of(cls, path: Path, sha256_of: Sha256Of) -> HeaderMapServer:
        """For the one model file at `path`."""
        return cls(lambda: [(path, sha256_of)])

    def _map(self, sha256: str) -> HeaderMap | None:
        if self._made is None or self._made.sha256 != sha256:
            path = next((p for p, sha256_of in self.files() if sha256_of() == sha256), None)
            if path is None:
                return None
            self._made = map_of(path, sha256)
        return self._made

    async def _answer(self, msg: dict[int, Any]) -> dict[int, Any]:
        sha256 = msg.get(K_SHA256)
        if not _is_sha256(sha256):
            return {K_ERROR: "a request names a sha256 (64 hex digits)"}
        try:
            found = await trio.to_thread.run_sync(self._map, sha256)
        except (OSError, ValueError) as e:
            log.warning("header_share.unreadable", sha256=sha256, error=str(e))
            return {K_ERROR: "the header here is unreadable"}
        if found is None:
            return {K_ERROR: "no whole header of that file here"}
        return {K_END: found.end, K_GAPS: [list(g) for g in found.gaps]}

    async def handle(self, stream: trio.abc.HalfCloseableStream) -> None:
        try:
            with trio.fail_after(ASK_TIMEOUT * 4):
                await stream.send_all(_encode(await self._answer(await _read(stream))))
                await stream.send_eof()
        except (MeshError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
            return  # the asker left or broke the protocol: it fetches the header whole
        finally:
            await stream.aclose()


def _parse_answer(msg: dict[int, Any], sha256: str) -> HeaderMap:
    """The map in a peer's answer, checked: a header end of 1 byte to `MAX_HEADER`, at most
    `MAX_GAPS` gaps in order within it, apart, each of at least one entry and a byte per
    entry. HeaderShareError otherwise, or with the peer's reason for having none."""
    if K_ERROR in msg:
        why = msg[K_ERROR]
        raise HeaderShareError(why[:200] if isinstance(why, str) else f"no map: {quoted(why)}")
    end, gaps = msg.get(K_END), msg.get(K_GAPS)
    if not _count(end) or not 0 < end <= MAX_HEADER:
        raise HeaderShareError(f"a header map's end is not 1 to {MAX_HEADER}: {quoted(end)}")
    if not isinstance(gaps, list) or len(gaps) > MAX_GAPS:
        raise HeaderShareError(f"a header map's gaps are not a list of at most {MAX_GAPS}")
    out: list[tuple[int, int, int]] = []
    for g in gaps:
        if not (isinstance(g, list) and len(g) == 3 and all(_count(x) for x in g)):
            raise HeaderShareError("a header map's gap is not [start, end, count]")
        start, stop, count = g
        after = out[-1][1] if out else 0
        if not (after <= start < stop <= end and 0 < count <= stop - start):
            raise HeaderShareError(f"a header map's gap {quoted(g, 60)} does not fit its header")
        out.append((start, stop, count))
    return HeaderMap(sha256, end, tuple(out))


def _count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _is_sha256(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


async def ask(open_stream: Callable[[], Awaitable[Any]], sha256: str) -> HeaderMap:
    """The map a peer gives for the file `sha256`: HeaderShareError if it has none."""
    stream = await open_stream()
    try:
        await stream.send_all(_encode({K_SHA256: sha256}))
        await stream.send_eof()
        return _parse_answer(await _read(stream), sha256)
    finally:
        await stream.aclose()


def ask_peers(addresses: Sequence[str], mesh: Any, sha256: str) -> HeaderMap | None:
    """The first map one of the peers at `addresses` gives, all asked at once with a
    throwaway identity of mesh `mesh` for at most `ASK_TIMEOUT` seconds in all (blocking; the
    agent is not up yet), or None."""
    from meshagent.identity.keys import NodeIdentity
    from meshagent.net.manager import ConnectionManager
    from meshagent.net.tcp import TcpTransport
    from meshagent.wire.handshake import LocalPeer

    found: list[HeaderMap] = []

    async def ask_one(node: ConnectionManager, address: str, done: trio.CancelScope) -> None:
        try:
            conn = await node.dial(address)
            found.append(await ask(lambda: conn.open_stream(LABEL), sha256))
        except (MeshError, OSError) as e:
            log.info("header_share.no_map", peer=address, error=str(e))
            return
        log.info("header_share.map", peer=address, left_out=found[-1].gap_bytes)
        done.cancel()  # the first answer is enough

    async def main() -> None:
        node = ConnectionManager(LocalPeer.create(NodeIdentity.generate(), mesh), TcpTransport())
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            try:
                with trio.move_on_after(ASK_TIMEOUT) as done:
                    async with trio.open_nursery() as asking:
                        for address in dict.fromkeys(addresses):
                            asking.start_soon(ask_one, node, address, done)
            finally:
                with trio.CancelScope(shield=True):
                    await node.aclose(grace=1.0)
                nursery.cancel_scope.cancel()

    trio.run(main)
    return found[0] if found else None
