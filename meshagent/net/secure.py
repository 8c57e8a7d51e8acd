"""Running the sans-IO handshake over a transport stream, with a timeout."""

from __future__ import annotations

import contextlib

import trio

from meshagent.net.errors import HandshakeInterrupted
from meshagent.wire.errors import HandshakeError
from meshagent.wire.handshake import Handshake, HandshakeResult, LocalPeer
from meshagent.wire.replay import ReplayGuard

_READ = 4096
_TRANSPORT_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


async def secure_handshake(
    stream: trio.abc.Stream,
    local: LocalPeer,
    *,
    initiator: bool,
    timeout: float,
    expected_peer_id: str | None = None,
    replay_guard: ReplayGuard | None = None,
) -> tuple[HandshakeResult, bytes]:
    """Authenticate both ends; returns the result and any bytes read past the handshake.

    Raises HandshakeError when the peer is refused and HandshakeInterrupted (a subclass)
    when the transport failed or `timeout` passed first.
    """
    hs = Handshake(
        local, initiator=initiator, expected_peer_id=expected_peer_id, replay_guard=replay_guard
    )
    try:
        with trio.fail_after(timeout):
            out = hs.start()
            if out:
                await stream.send_all(out)
            while not hs.done:
                data = await stream.receive_some(_READ)
                if not data:
                    raise HandshakeInterrupted(
                        "peer closed the connection during the handshake (it may use another "
                        "mesh secret or protocol version, or refused us)"
                    )
                try:
                    out = hs.receive_data(data)
                except HandshakeError:
                    if hs.refusal:
                        # Tell an honest initiator not to retry; best effort, never waited on.
                        with trio.move_on_after(1), contextlib.suppress(*_TRANSPORT_ERRORS):
                            await stream.send_all(hs.refusal)
                    raise
                if out:
                    await stream.send_all(out)
    except trio.TooSlowError as e:
        raise HandshakeInterrupted(f"handshake timed out after {timeout:g} s") from e
    except _TRANSPORT_ERRORS as e:
        raise HandshakeInterrupted(f"transport failed during the handshake: {e}") from e
    return hs.result, hs.trailing_data()
