"""Moving stage artifacts between peers over overlay streams: chunked, verified, resumable.

One stream (label `artifact/1`) per transfer. The client sends a GET (artifact key, first chunk
wanted); the server answers with a HEADER (the manifest, the chunk size and the sha256 of every
chunk) and then the chunks in order, each as `u32 length | bytes`. The client checks every chunk
against its hash as it arrives and writes it to a partial file; a chunk that fails is fetched
again (a new GET from that chunk), a transfer cut off resumes from the last verified chunk, and
the whole file is checked against the manifest's sha256 before it is installed. Nothing
unverified is ever installed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import cbor2
import structlog
import trio

from meshagent.errors import MeshError
from meshagent.models.artifacts import ArtifactStore, SliceManifest
from meshagent.net.framed import receive_cbor, receive_frame
from meshagent.wire.framing import Framing, LengthPrefixDecoder

log = structlog.get_logger(__name__)

LABEL = "artifact/1"
VERSION = 1
CHUNK_SIZE = 1 << 20
MAX_MESSAGE = 1 << 20  # a header holds 32 bytes per chunk: enough for 32 GiB artifacts
_MAX_CHUNK = (1 << 32) - 1  # what a u32 length can say
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


# ----- framing ------------------------------------------------------------------------------

# Messages (GET, HEADER, ERROR) and then chunks: both `u32 length | bytes`.
FRAMING = Framing("transfer message", width=4, max_size=MAX_MESSAGE, error=TransferError)


def _ended_early() -> TransferError:
    return TransferError("the peer ended the transfer early")


async def _read_frame(stream: trio.abc.ReceiveStream, frames: LengthPrefixDecoder) -> bytes:
    return await receive_frame(stream, frames, on_eof=_ended_early, receive_size=_RECEIVE)


async def _read_message(
    stream: trio.abc.ReceiveStream, frames: LengthPrefixDecoder
) -> dict[int, Any]:
    return await receive_cbor(
        stream,
        frames,
        version=VERSION,
        on_eof=_ended_early,
        error=TransferError,
        what="transfer message",
        receive_size=_RECEIVE,
    )


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
    """Answers artifact GETs from a store; at most `max_uploads` at once (others wait)."""

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
        try:
            req = await _read_message(stream, LengthPrefixDecoder(FRAMING))
        except TransferError as e:
            await stream.send_all(_message({K_TYPE: T_ERROR, K_ERROR: str(e)}))
            return
        if req.get(K_TYPE) != T_GET or not isinstance(req.get(K_KEY), str):
            await stream.send_all(_message({K_TYPE: T_ERROR, K_ERROR: "expected a GET"}))
            return
        manifest = self.store.get(req[K_KEY])
        if manifest is None and self._cut is not None and self._may_cut(req[K_KEY]):
            manifest = await trio.to_thread.run_sync(self._cut_or_none, req[K_KEY])
        if manifest is None:
            err = f"no artifact {req[K_KEY]} here"
            await stream.send_all(_message({K_TYPE: T_ERROR, K_ERROR: err}))
            return
        path = self.store.blob_path(manifest.sha256)
        hashes = self._hashes.get(manifest.sha256)
        if hashes is None:
            hashes = await trio.to_thread.run_sync(chunk_hashes, path, self.chunk_size)
            self._hashes[manifest.sha256] = hashes
        first = int(req.get(K_FROM, 0))
        if not 0 <= first <= len(hashes):
            await stream.send_all(_message({K_TYPE: T_ERROR, K_ERROR: "chunk out of range"}))
            return
        async with self._slots:
            header = {
                K_TYPE: T_HEADER,
                K_MANIFEST: manifest.to_cbor(),
                K_CHUNK: self.chunk_size,
                K_HASHES: b"".join(hashes),
            }
            await stream.send_all(_message(header))
            with path.open("rb") as f:
                f.seek(first * self.chunk_size)
                for index in range(first, len(hashes)):
                    data = await trio.to_thread.run_sync(f.read, self.chunk_size)
                    if self._corrupt is not None:
                        data = self._corrupt(index, data)
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
    progress: Progress | None = None,
    max_attempts: int = 5,
) -> tuple[Path, SliceManifest]:
    """Fetch artifact `key` into `store` through streams from `open_stream`; resumes a partial
    transfer left by an earlier call. Returns the installed file and its manifest."""
    have = store.get(key)
    if have is not None and expected_sha256 in (None, have.sha256):
        return store.blob_path(have.sha256), have
    partial_dir = store.root / "partial"
    partial_dir.mkdir(exist_ok=True)
    part = _Partial(partial_dir / f"{key}.part", partial_dir / f"{key}.part.json")
    part.load()
    failures = 0
    while True:
        try:
            manifest = await _fetch_once(open_stream, key, part, expected_sha256, progress)
            break
        except PeerRefused:
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
    path = store.install(manifest, part.data)
    part.discard()
    log.info("artifact.fetched", key=key, sha256=manifest.sha256, bytes=manifest.size_bytes)
    return path, manifest


async def _fetch_once(
    open_stream: OpenStream,
    key: str,
    part: _Partial,
    expected_sha256: str | None,
    progress: Progress | None,
) -> SliceManifest:
    stream = await open_stream()
    async with stream:
        await stream.send_all(_message({K_TYPE: T_GET, K_KEY: key, K_FROM: part.verified}))
        await stream.send_eof()
        frames = LengthPrefixDecoder(FRAMING)
        header = await _read_message(stream, frames)
        if header.get(K_TYPE) == T_ERROR:
            raise PeerRefused(f"the peer refused: {header.get(K_ERROR)}")
        if header.get(K_TYPE) != T_HEADER:
            raise TransferError("expected a transfer header")
        manifest = SliceManifest.from_cbor(header[K_MANIFEST])
        if manifest.key != key:
            raise TransferError(f"asked for {key}, the peer sent {manifest.key}")
        if expected_sha256 and manifest.sha256 != expected_sha256:
            raise TransferError(f"the peer's {key} is {manifest.sha256}, not {expected_sha256}")
        chunk_size = int(header[K_CHUNK])
        if not 0 < chunk_size <= _MAX_CHUNK:
            raise TransferError(f"the peer's chunk size {chunk_size} is out of range")
        # After the HEADER the stream carries only chunks, each at most the chunk size.
        chunk_framing = replace(FRAMING, what="chunk", max_size=chunk_size)
        chunks = LengthPrefixDecoder(chunk_framing, frames.leftover())
        raw = header[K_HASHES]
        hashes = [raw[i : i + 32] for i in range(0, len(raw), 32)]
        if part.sha256 != manifest.sha256 or part.chunk_size != chunk_size:
            part.discard()
            part.sha256, part.chunk_size, part.verified = manifest.sha256, chunk_size, 0
        total = manifest.size_bytes
        mode = "r+b" if part.data.exists() else "wb"
        with part.data.open(mode) as f:
            f.truncate(part.verified * chunk_size)
            f.seek(part.verified * chunk_size)
            for index in range(part.verified, len(hashes)):
                data = await _read_frame(stream, chunks)
                if hashlib.sha256(data).digest() != hashes[index]:
                    raise ChunkCorrupt(f"chunk {index} of {key} failed its sha256")
                f.write(data)
                f.flush()
                part.verified = index + 1
                part.save()
                if progress is not None:
                    progress(min(part.verified * chunk_size, total), total)
    return manifest
