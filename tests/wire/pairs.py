"""Helpers that wire two sans-IO endpoints together without any I/O."""

from __future__ import annotations

from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret
from meshagent.wire.events import Event
from meshagent.wire.frames import decode_frame
from meshagent.wire.handshake import Handshake, HandshakeResult, LocalPeer
from meshagent.wire.mux import Multiplexer
from meshagent.wire.settings import StreamSettings

MESH = MeshSecret(b"\x07" * 32)


def peer(mesh: MeshSecret = MESH, **kwargs) -> LocalPeer:
    return LocalPeer.create(NodeIdentity.generate(), mesh, **kwargs)


def run_handshake(
    initiator: Handshake, responder: Handshake
) -> tuple[HandshakeResult, HandshakeResult, list[bytes]]:
    """Drive both sides to completion; returns both results and the messages exchanged."""
    messages = [initiator.start()]
    assert responder.start() == b""
    messages.append(responder.receive_data(messages[0]))
    messages.append(initiator.receive_data(messages[1]))
    assert responder.receive_data(messages[2]) == b""
    return initiator.result, responder.result, messages


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def mux_pair(
    a_settings: StreamSettings | None = None, b_settings: StreamSettings | None = None
) -> tuple[Multiplexer, Multiplexer, Clock]:
    a_settings = a_settings or StreamSettings()
    b_settings = b_settings or StreamSettings()
    clock = Clock()
    a = Multiplexer(
        initiator=True, local_settings=a_settings, remote_settings=b_settings, clock=clock
    )
    b = Multiplexer(
        initiator=False, local_settings=b_settings, remote_settings=a_settings, clock=clock
    )
    return a, b, clock


def pump(src: Multiplexer, dst: Multiplexer) -> list[Event]:
    """Move everything `src` has queued into `dst` (no encryption: frames only)."""
    events: list[Event] = []
    while src.has_output:
        for raw in src.frames_to_send():
            events.extend(dst.handle_frame(decode_frame(raw)))
    return events
