"""Path probe: push bytes to a peer over the overlay and check they all arrived.

`meshagent peers --probe PEER` uses it to show that a path works and how fast; the relay
acceptance test uses it to move a known plaintext across a relay and through a change of
path. One stream (label `probe/1`): the prober sends the bytes (paced over `seconds` if
asked) and half-closes; the peer replies with sha256 and the byte count.
"""

from __future__ import annotations

import hashlib
import struct

import structlog
import trio

from meshagent.errors import MeshError
from meshagent.net.manager import ConnectionManager
from meshagent.net.stream import MeshStream

log = structlog.get_logger(__name__)

LABEL = "probe/1"
PAYLOAD = b"MESHAGENT PROBE PLAINTEXT: every byte of this is checked at the other end. "
MAX_BYTES = 1 << 30
_CHUNK = 64 * 1024
_REPLY = struct.Struct(">32sQ")


class ProbeError(MeshError):
    pass


async def serve(stream: MeshStream) -> None:
    """Read to EOF; reply sha256 and byte count; half-close."""
    digest, total = hashlib.sha256(), 0
    while data := await stream.receive_some():
        digest.update(data)
        total += len(data)
        if total > MAX_BYTES:
            stream.reset(f"probe over the {MAX_BYTES}-byte limit")
            return
    await stream.send_all(_REPLY.pack(digest.digest(), total))
    await stream.send_eof()
    await stream.aclose()


def _chunk() -> bytes:
    return (PAYLOAD * (_CHUNK // len(PAYLOAD) + 1))[:_CHUNK]


async def probe(
    overlay: ConnectionManager, peer_id: str, *, total: int, seconds: float = 0.0
) -> dict[str, object]:
    """Send `total` bytes to `peer_id` (spread over `seconds`) and verify the reply."""
    if not 0 < total <= MAX_BYTES:
        raise ProbeError(f"probe size must be 1 byte to {MAX_BYTES} bytes")
    stream = await overlay.open_stream(peer_id, LABEL)
    conn = stream.connection
    log.info("probe.started", peer=peer_id, path=conn.path, session=conn.session_id, bytes=total)
    started = trio.current_time()
    digest, sent = hashlib.sha256(), 0
    chunk = _chunk()
    try:
        while sent < total:
            data = chunk[: min(len(chunk), total - sent)]
            if seconds > 0:
                await trio.sleep_until(started + seconds * sent / total)
            await stream.send_all(data)
            digest.update(data)
            sent += len(data)
        await stream.send_eof()
        reply = b""
        while data := await stream.receive_some():
            reply += data
    finally:
        await stream.aclose()
    elapsed = trio.current_time() - started
    if len(reply) != _REPLY.size:
        raise ProbeError(f"peer {peer_id} sent a malformed probe reply")
    their_hash, their_total = _REPLY.unpack(reply)
    ok = their_hash == digest.digest() and their_total == sent
    active = overlay.connection(peer_id)
    return {
        "peer_id": peer_id,
        "ok": ok,
        "bytes": sent,
        "bytes_received_by_peer": their_total,
        "seconds": round(elapsed, 3),
        "mbit_per_s": round(sent * 8 / elapsed / 1e6, 2) if elapsed > 0 else None,
        "path": conn.path,
        "session": conn.session_id,
        "path_after": active.path if active is not None else None,
        "session_after": active.session_id if active is not None else None,
    }
