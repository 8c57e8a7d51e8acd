"""Path probe: push bytes to a peer over the overlay and check they all arrived.

`meshagent peers --probe PEER` uses it to show that a path works and how fast; the relay
acceptance test uses it to move a known plaintext across a relay and through a change of
path. One stream (label `probe/1`): the prober sends the bytes (paced over `seconds` if
asked) and half-closes; the peer replies with sha256 and the byte count (`read_reply`: a
count past `MAX_BYTES` is no answer, since the peer resets a longer probe).

Both ends are bounded: at most `MAX_BYTES`, paced over at most `MAX_SECONDS`; each side gives
up `SLACK` seconds after the pacing would have ended, and the prober waits at most
`REPLY_DEADLINE` for the reply once it sent everything, so neither a slow link nor a peer that
never answers holds a stream, or the HTTP request that asked for the probe, for long.
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
MAX_BYTES = 64 << 20
MAX_SECONDS = 60.0  # the longest pacing a probe may ask for
SLACK = 30.0  # seconds, past its pacing, that a probe's bytes may take to cross
REPLY_DEADLINE = 15.0  # seconds the prober waits for the reply once it sent everything
_CHUNK = 64 * 1024
_REPLY = struct.Struct(">32sQ")


class ProbeError(MeshError):
    pass


class ProbeTimeout(ProbeError):
    """The probe did not finish within its deadline."""


async def serve(stream: MeshStream) -> None:
    """Read to EOF (at most `MAX_BYTES`, within the longest probe's time); reply sha256 and
    byte count; half-close."""
    digest, total = hashlib.sha256(), 0
    with trio.move_on_after(MAX_SECONDS + SLACK) as timer:
        while data := await stream.receive_some():
            digest.update(data)
            total += len(data)
            if total > MAX_BYTES:
                log.warning("probe.refused", peer=stream.peer_id, why="size", bytes=total)
                stream.reset(f"probe over the {MAX_BYTES}-byte limit")
                return
    if timer.cancelled_caught:
        log.warning("probe.refused", peer=stream.peer_id, why="time", bytes=total)
        stream.reset(f"probe not ended within {MAX_SECONDS + SLACK:g} s")
        return
    await stream.send_all(_REPLY.pack(digest.digest(), total))
    await stream.send_eof()
    await stream.aclose()


def read_reply(data: bytes) -> tuple[bytes, int]:
    """The peer's reply: the sha256 of what it received and its byte count, at most
    `MAX_BYTES` (it resets a longer probe); ProbeError naming what is out of range."""
    if len(data) != _REPLY.size:
        raise ProbeError(f"a probe reply is {_REPLY.size} bytes, not {len(data)} bytes")
    digest, total = _REPLY.unpack(data)
    if total > MAX_BYTES:
        raise ProbeError(
            f"a probe reply counts {total} bytes, over the {MAX_BYTES} any probe sends"
        )
    return digest, total


def check(total: int, seconds: float) -> None:
    """ProbeError unless a probe of `total` bytes over `seconds` is within the bounds."""
    if not 0 < total <= MAX_BYTES:
        raise ProbeError(f"a probe's 'bytes' must be 1 to {MAX_BYTES}, not {total}")
    if not 0 <= seconds <= MAX_SECONDS:
        raise ProbeError(f"a probe's 'seconds' must be 0 to {MAX_SECONDS:g}, not {seconds}")


def _chunk() -> bytes:
    return (PAYLOAD * (_CHUNK // len(PAYLOAD) + 1))[:_CHUNK]


async def probe(
    overlay: ConnectionManager, peer_id: str, *, total: int, seconds: float = 0.0
) -> dict[str, object]:
    """Send `total` bytes to `peer_id` (spread over `seconds`) and verify the reply;
    ProbeTimeout when sending takes `SLACK` seconds past `seconds`, or the reply
    `REPLY_DEADLINE` seconds past the last byte."""
    check(total, seconds)
    stream = await overlay.open_stream(peer_id, LABEL)
    conn = stream.connection
    log.info("probe.started", peer=peer_id, path=conn.path, session=conn.session_id, bytes=total)
    started = trio.current_time()
    digest, sent = hashlib.sha256(), 0
    chunk = _chunk()
    waiting = "to send"
    try:
        with trio.fail_after(seconds + SLACK):
            while sent < total:
                data = chunk[: min(len(chunk), total - sent)]
                if seconds > 0:
                    await trio.sleep_until(started + seconds * sent / total)
                await stream.send_all(data)
                digest.update(data)
                sent += len(data)
            await stream.send_eof()
        waiting = "for the reply"
        reply = b""
        with trio.fail_after(REPLY_DEADLINE):
            while len(reply) <= _REPLY.size and (data := await stream.receive_some()):
                reply += data
    except trio.TooSlowError as e:
        stream.reset("probe deadline")
        raise ProbeTimeout(
            f"the probe of peer {peer_id} timed out waiting {waiting} ({sent} of {total} "
            f"bytes sent in {trio.current_time() - started:.1f} s)"
        ) from e
    finally:
        await stream.aclose()
    elapsed = trio.current_time() - started
    try:
        their_hash, their_total = read_reply(reply)
    except ProbeError as e:
        raise ProbeError(f"peer {peer_id} sent a malformed probe reply: {e}") from e
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
