"""Moving stage artifacts between peers over overlay streams: chunked, verified, resumable.

One stream (label `artifact/1`) per transfer. The client sends a GET (artifact key, first chunk
wanted); the server answers with a HEADER (the manifest, the chunk size and the sha256 of every
chunk) and then the chunks in order, each as `u32 length | bytes`. The client checks every chunk
against its hash as it arrives and writes it to a partial file; a chunk that fails is fetched
again (a new GET from that chunk), a transfer cut off resumes from the last verified chunk, and
the whole file is checked against the manifest's sha256 before it is installed. Nothing
unverified is ever installed.

Either side checks what the other sends once, where it is decoded (`_Request`, `_Header`): a
HEADER's manifest, sizes and hashes against each other and against what the asker expects
(the artifact's size where it knows it, its disk), before a byte is written; a bad message
ends that transfer with a clear error (`PeerMisbehaved`), never the agent. A server serves
`MAX_UPLOADS_PER_PEER` transfers to one peer at once and drops a reader that takes no chunk
for `CHUNK_DEADLINE` seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import cbor2
import structlog
import trio

from meshagent.errors import MeshError, ModelError
from meshagent.models.artifacts import ArtifactStore, SliceManifest, parse_key
from meshagent.net.frame_reader import receive_cbor, receive_frame
from meshagent.wire.framing import Framing, LengthPrefixDecoder
from meshagent.wire.quoted import quoted

log = structlog.get_logger(__name__)

LABEL = "artifact/1"
VERSION = 1
CHUNK_SIZE = 1 << 20  # what a server sends
# The largest chunk an asker takes: it holds one chunk in memory to check it before writing.
MAX_CHUNK = 4 << 20
MAX_MESSAGE = 1 << 20  # a header holds 32 bytes per chunk: enough for 32 GiB artifacts
MAX_KEY = 200  # characters of an artifact key
MAX_UPLOADS_PER_PEER = 2  # transfers one peer is served at once; more are refused
CHUNK_DEADLINE = 60.0  # seconds a side waits for the other to take or send the next message
DISK_RESERVE = 256 << 20  # bytes an asker keeps free on its disk after a transfer
_RECEIVE = 65536  # bytes per receive, or the rest of a larger frame

# message keys (cbor maps with small integer keys)
K_VERSION, K_TYPE, K_KEY, K_FROM, K_MANIFEST, K_CHUNK, K_HASHES, K_ERROR = range(8)
T_GET, T_HEADER, T_ERROR = 1, 2, 3

Progress = Callable[[int, int], None]
OpenStream = Callable[[], Awaitable[trio.abc.HalfCloseableStream]]


class TransferError(MeshError):
    """A transfer failed; the message says whether retrying can help."""


class ChunkCorrupt(TransferError):
    pass


class PeerRefused(TransferError):
    """The peer does not have the artifact (or refused the request): asking again won't help."""


class PeerMisbehaved(PeerRefused):
    """The peer sent a message against the protocol or against what the asker knows (a
    malformed header, a size other than expected): asking it again won't help."""


class NoRoom(TransferError):
    """The artifact does not fit this agent's disk: asking again won't help until room is
    made."""


# ----- framing ------------------------------------------------------------------------------

# Messages (GET, HEADER, ERROR) and then chunks: both `u32 length | bytes`.
FRAMING = Framing("transfer message", width=4, max_size=MAX_MESSAGE, error=TransferError)


def _ended_early() -> TransferError:
    return TransferError("the peer ended the transfer early")


async def _read_frame(stream: trio.abc.ReceiveStream, frames: LengthPrefixDecoder) -> bytes:
    with _deadline("a chunk"):
        return await receive_frame(stream, frames, on_eof=_ended_early, receive_size=_RECEIVE)


async def _read_message(
    stream: trio.abc.ReceiveStream, frames: LengthPrefixDecoder
) -> dict[int, Any]:
    with _deadline("a message"):
        return await receive_cbor(
            stream,
            frames,
            version=VERSION,
            on_eof=_ended_early,
            error=TransferError,
            what="transfer message",
            receive_size=_RECEIVE,
        )


@contextlib.contextmanager
def _deadline(what: str) -> Iterator[None]:
    """`CHUNK_DEADLINE` for one step of a transfer: past it, TransferError."""
    try:
        with trio.fail_after(CHUNK_DEADLINE):
            yield
    except trio.TooSlowError:
        raise TransferError(f"{what} did not pass within {CHUNK_DEADLINE:g} s") from None


def _uint(v: Any) -> bool:
    return type(v) is int and v >= 0


@dataclass(frozen=True)
class _Request:
    """A GET: the artifact `key` and the first chunk wanted."""

    key: str
    first: int

    @classmethod
    def decode(cls, msg: dict[int, Any]) -> _Request:
        """The GET in `msg`; PeerMisbehaved (its reason fit to send back) if it is not one."""
        key, first = msg.get(K_KEY), msg.get(K_FROM, 0)
        if msg.get(K_TYPE) != T_GET or type(msg.get(K_TYPE)) is not int:
            raise PeerMisbehaved("expected a GET")
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY:
            raise PeerMisbehaved(f"a GET names an artifact key of at most {MAX_KEY} characters")
        if not _uint(first):
            raise PeerMisbehaved("a GET's first chunk is a count from 0")
        return cls(key, first)


@dataclass(frozen=True)
class _Header:
    """A HEADER, checked: the manifest of the artifact asked for, its chunk size and the
    sha256 of every chunk, as many as its size takes."""

    manifest: SliceManifest
    chunk_size: int
    hashes: tuple[bytes, ...]

    @classmethod
    def decode(cls, msg: dict[int, Any], key: str, expect: Expected) -> _Header:
        """The HEADER in `msg` for artifact `key`; PeerRefused for an ERROR, PeerMisbehaved
        for anything else that is not a HEADER or not what `expect` allows."""
        kind = msg.get(K_TYPE)
        if kind == T_ERROR and type(kind) is int:
            reason = msg.get(K_ERROR)
            said = reason[:200] if isinstance(reason, str) else quoted(reason)
            raise PeerRefused(f"the peer refused: {said}")
        if kind != T_HEADER or type(kind) is not int:
            raise PeerMisbehaved("expected a transfer header")
        raw, chunk, hashes = msg.get(K_MANIFEST), msg.get(K_CHUNK), msg.get(K_HASHES)
        if not isinstance(raw, bytes):
            raise PeerMisbehaved("a transfer header without a manifest")
        try:
            manifest = SliceManifest.from_cbor(raw)
        except ModelError as e:
            raise PeerMisbehaved(f"the peer's {e}") from e
        if manifest.key != key:
            raise PeerMisbehaved(f"asked for {key}, the peer sent {manifest.key}")
        if expect.sha256 and manifest.sha256 != expect.sha256:
            raise PeerMisbehaved(f"the peer's {key} is {manifest.sha256}, not {expect.sha256}")
        size = manifest.size_bytes
        if expect.size is not None and size != expect.size:
            raise PeerMisbehaved(f"the peer's {key} is {size} bytes, not {expect.size}")
        if expect.most is not None and size > expect.most:
            raise PeerMisbehaved(f"the peer's {key} is {size} bytes, over the {expect.most}")
        if not _uint(chunk) or not 0 < chunk <= MAX_CHUNK:
            raise PeerMisbehaved(f"the peer's chunk size {quoted(chunk)} is not 1 to {MAX_CHUNK}")
        count = math.ceil(size / chunk)
        if not isinstance(hashes, bytes) or len(hashes) != 32 * count:
            got = len(hashes) / 32 if isinstance(hashes, bytes) else type(hashes).__name__
            raise PeerMisbehaved(
                f"the peer's {key} of {size} bytes in chunks of {chunk} has {count} chunks, "
                f"but the header gives {got} hashes"
            )
        return cls(manifest, chunk, tuple(hashes[i : i + 32] for i in range(0, len(hashes), 32)))

    def chunk_length(self, index: int) -> int:
        """How many bytes chunk `index` holds: the chunk size, the last one what is left."""
        return min(self.chunk_size, self.manifest.size_bytes - index * self.chunk_size)


@dataclass(frozen=True)
class Expected:
    """What the asker knows of the artifact it asks for: its sha256 (the one a peer
    publishes), its exact size (likewise), or a size it cannot be over (its model's file)."""

    sha256: str | None = None
    size: int | None = None
    most: int | None = None


def free_disk(path: Path) -> int:
    """Bytes free on the disk that holds `path`."""
    return shutil.disk_usage(path).free


def _message(fields: dict[int, Any]) -> bytes:
    return FRAMING.encode(cbor2.dumps({K_VERSION: VERSION, **fields}))


def chunk_hashes(path: Path, chunk_size: int = CHUNK_SIZE) -> list[bytes]:
    hashes = []
    with path.open("rb") as f:
        while block := f.read(chunk_size):
            hashes.append(hashlib.sha256(block).digest())
    return hashes


# ----- server -------------------------------------------------------------------------------

Corrupter = Callable[[int, bytes], bytes]
# Cuts artifact `key` from the whole model file this agent holds, for a peer that asks for it
# (blocking); None when it cannot (another model, or no whole file here).
Cutter = Callable[[str], SliceManifest | None]


class ArtifactServer:
    """Answers artifact GETs from a store: at most `max_uploads` transfers at once, at most
    `MAX_UPLOADS_PER_PEER` of them to one peer (others wait), so that no peer takes every
    slot."""

    def __init__(
        self,
        store: ArtifactStore,
        *,
        max_uploads: int = 4,
        chunk_size: int = CHUNK_SIZE,
        corrupt: Corrupter | None = None,
        cut: Cutter | None = None,
        may_cut: Callable[[str], bool] = lambda key: True,
    ) -> None:
        self.store = store
        self._cut = cut
        # Which keys a peer may have cut here (asked on the event loop): those a plan needs,
        # not every range a member cares to name (each cut takes disk).
        self._may_cut = may_cut
        self.chunk_size = chunk_size
        self._slots = trio.Semaphore(max_uploads)
        self._peer_slots: dict[str, trio.Semaphore] = {}
        self._peer_streams: dict[str, int] = {}  # while a peer has none, its slots go
        self._hashes: dict[str, list[bytes]] = {}
        self._corrupt = corrupt  # tests: damage chunks in transit, above the encryption

    def _cut_or_none(self, key: str) -> SliceManifest | None:
        assert self._cut is not None
        try:
            return self._cut(key)
        except MeshError as e:
            log.warning("artifact.cut_for_peer_failed", key=key, error=str(e))
            return None

    async def handle(self, stream: trio.abc.HalfCloseableStream) -> None:
        peer = getattr(stream, "peer_id", "?")  # a plain stream (tests): one peer
        slots = self._peer_slots.setdefault(peer, trio.Semaphore(MAX_UPLOADS_PER_PEER))
        self._peer_streams[peer] = self._peer_streams.get(peer, 0) + 1
        try:
            async with slots:
                await self._serve(stream)
        except (MeshError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            log.info("artifact.upload_ended", peer=peer, reason=str(e))
        finally:
            self._peer_streams[peer] -= 1
            if not self._peer_streams[peer]:
                del self._peer_streams[peer], self._peer_slots[peer]

    async def _serve(self, stream: trio.abc.HalfCloseableStream) -> None:
        try:
            req = _Request.decode(await _read_message(stream, LengthPrefixDecoder(FRAMING)))
        except TransferError as e:
            await stream.send_all(_message({K_TYPE: T_ERROR, K_ERROR: str(e)}))
            return
        manifest = self.store.get(req.key) if parse_key(req.key) is not None else None
        if manifest is None and self._cut is not None and self._may_cut(req.key):
            manifest = await trio.to_thread.run_sync(self._cut_or_none, req.key)
        if manifest is None:
            err = f"no artifact {req.key} here"
            await stream.send_all(_message({K_TYPE: T_ERROR, K_ERROR: err}))
            return
        path = self.store.blob_path(manifest.sha256)
        hashes = self._hashes.get(manifest.sha256)
        if hashes is None:
            hashes = await trio.to_thread.run_sync(chunk_hashes, path, self.chunk_size)
            self._hashes[manifest.sha256] = hashes
        if req.first > len(hashes):
            await stream.send_all(_message({K_TYPE: T_ERROR, K_ERROR: "chunk out of range"}))
            return
        async with self._slots:
            header = {
                K_TYPE: T_HEADER,
                K_MANIFEST: manifest.to_cbor(),
                K_CHUNK: self.chunk_size,
                K_HASHES: b"".join(hashes),
            }
            with _deadline("the header"):
                await stream.send_all(_message(header))
            with path.open("rb") as f:
                f.seek(req.first * self.chunk_size)
                for index in range(req.first, len(hashes)):
                    data = await trio.to_thread.run_sync(f.read, self.chunk_size)
                    if self._corrupt is not None:
                        data = self._corrupt(index, data)
                    with _deadline(f"chunk {index}"):  # a reader that stalls frees the slot
                        await stream.send_all(FRAMING.encode(data))
            await stream.send_eof()


# ----- client -------------------------------------------------------------------------------


@dataclass
class _Partial:
    """What is on disk of an unfinished transfer."""

    data: Path
    meta: Path
    sha256: str = ""
    chunk_size: int = 0
    verified: int = 0  # chunks written and checked

    def load(self) -> None:
        try:
            meta = json.loads(self.meta.read_text())
            self.sha256, self.chunk_size = meta["sha256"], int(meta["chunk_size"])
            self.verified = int(meta["verified"])
        except (OSError, ValueError, KeyError):
            self.verified = 0
            return
        size = self.data.stat().st_size if self.data.exists() else 0
        self.verified = min(self.verified, size // max(self.chunk_size, 1))

    def save(self) -> None:
        meta = {"sha256": self.sha256, "chunk_size": self.chunk_size, "verified": self.verified}
        tmp = self.meta.with_name(self.meta.name + ".tmp")
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, self.meta)

    def discard(self) -> None:
        self.data.unlink(missing_ok=True)
        self.meta.unlink(missing_ok=True)


async def fetch_artifact(
    open_stream: OpenStream,
    key: str,
    store: ArtifactStore,
    *,
    expected_sha256: str | None = None,
    expected_size: int | None = None,
    max_size: int | None = None,
    progress: Progress | None = None,
    max_attempts: int = 5,
) -> tuple[Path, SliceManifest]:
    """Fetch artifact `key` into `store` through streams from `open_stream`; resumes a partial
    transfer left by an earlier call. The peer's header must agree with what the caller knows:
    `expected_sha256` and `expected_size` (as published for the artifact), a size of at most
    `max_size`. Returns the installed file and its manifest. TransferError when it could not:
    PeerRefused (PeerMisbehaved where the peer broke the protocol) or NoRoom at once, other
    failures after `max_attempts`."""
    have = store.get(key)
    if have is not None and expected_sha256 in (None, have.sha256):
        return store.blob_path(have.sha256), have
    expect = Expected(expected_sha256, expected_size, max_size)
    partial_dir = store.root / "partial"
    partial_dir.mkdir(exist_ok=True)
    part = _Partial(partial_dir / f"{key}.part", partial_dir / f"{key}.part.json")
    part.load()
    failures = 0
    while True:
        try:
            manifest = await _fetch_once(open_stream, key, part, expect, progress)
            break
        except (PeerRefused, NoRoom):
            raise
        except ChunkCorrupt as e:
            failures += 1
            log.warning("artifact.chunk_corrupt", key=key, error=str(e), attempt=failures)
        except (TransferError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            failures += 1
            log.warning("artifact.transfer_broken", key=key, error=str(e), attempt=failures)
        except MeshError as e:  # the overlay's own errors (connection or stream gone)
            failures += 1
            log.warning("artifact.transfer_broken", key=key, error=str(e), attempt=failures)
        if failures >= max_attempts:
            raise TransferError(
                f"could not fetch artifact {key} after {failures} attempts; "
                f"{part.verified} chunks are kept and the next fetch resumes there"
            )
    path = await trio.to_thread.run_sync(store.install, manifest, part.data)
    part.discard()
    log.info("artifact.fetched", key=key, sha256=manifest.sha256, bytes=manifest.size_bytes)
    return path, manifest


async def _fetch_once(
    open_stream: OpenStream,
    key: str,
    part: _Partial,
    expect: Expected,
    progress: Progress | None,
) -> SliceManifest:
    stream = await open_stream()
    async with stream:
        await stream.send_all(_message({K_TYPE: T_GET, K_KEY: key, K_FROM: part.verified}))
        await stream.send_eof()
        frames = LengthPrefixDecoder(FRAMING)
        header = _Header.decode(await _read_message(stream, frames), key, expect)
        manifest, chunk_size, total = header.manifest, header.chunk_size, header.manifest.size_bytes
        if part.sha256 != manifest.sha256 or part.chunk_size != chunk_size:
            part.discard()
            part.sha256, part.chunk_size, part.verified = manifest.sha256, chunk_size, 0
        part.verified = min(part.verified, len(header.hashes))
        need = total - part.verified * chunk_size
        free = free_disk(part.data.parent)
        if need + DISK_RESERVE > free:
            raise NoRoom(
                f"artifact {key} needs {need} more bytes on disk and {DISK_RESERVE} to spare; "
                f"{free} are free: make room (`meshagent models` lists what the store holds)"
            )
        # After the HEADER the stream carries only chunks, each at most the chunk size.
        chunk_framing = replace(FRAMING, what="chunk", max_size=chunk_size)
        chunks = LengthPrefixDecoder(chunk_framing, frames.leftover())
        mode = "r+b" if part.data.exists() else "wb"
        with part.data.open(mode) as f:
            f.truncate(part.verified * chunk_size)
            f.seek(part.verified * chunk_size)
            for index in range(part.verified, len(header.hashes)):
                data = await _read_frame(stream, chunks)
                if len(data) != header.chunk_length(index):
                    raise PeerMisbehaved(
                        f"chunk {index} of {key} is {len(data)} bytes, "
                        f"not {header.chunk_length(index)}"
                    )
                if hashlib.sha256(data).digest() != header.hashes[index]:
                    raise ChunkCorrupt(f"chunk {index} of {key} failed its sha256")
                f.write(data)
                f.flush()
                part.verified = index + 1
                part.save()
                if progress is not None:
                    progress(min(part.verified * chunk_size, total), total)
    return manifest
