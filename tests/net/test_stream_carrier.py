"""A stream over a scripted carrier: what `MeshStream` asks of its connection (the
`StreamCarrier` protocol), and what the connection's calls back do to it."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from meshagent.net.errors import StreamResetError
from meshagent.net.stream import MeshStream
from meshagent.wire.errors import ErrorCode


class Carrier:
    """Takes `credit` bytes; hands out what `incoming` holds; records every call."""

    peer_id = "peer"
    session_id = "s1"
    path = "direct"

    def __init__(self, credit: int = 1 << 20) -> None:
        self.credit = credit
        self.sent = bytearray()
        self.incoming: list[bytes] = []
        self.calls: list[tuple] = []

    def send_data(self, stream_id, view):
        n = min(self.credit, len(view))
        self.credit -= n
        self.sent += view[:n]
        return n

    async def write_inline(self):
        self.calls.append(("write_inline",))

    def write_now(self):
        self.calls.append(("write_now",))

    def has_send_credit(self, stream_id):
        return self.credit > 0

    def read_data(self, stream_id, max_bytes):
        return self.incoming.pop(0) if self.incoming else None

    async def read_until(self, stream, ready):
        self.calls.append(("read_until",))

    def send_eof(self, stream_id):
        self.calls.append(("send_eof", stream_id))

    def reset_stream(self, stream_id, code, reason):
        self.calls.append(("reset_stream", stream_id, code, reason))

    remote_open = True

    def is_remote_open(self, stream_id):
        return self.remote_open

    def forget_stream(self, stream_id):
        self.calls.append(("forget_stream", stream_id))


async def test_send_all_waits_for_credit_the_carrier_grants():
    carrier = Carrier(credit=3)
    stream = MeshStream(carrier, 5, "x")
    async with trio.open_nursery() as n:
        n.start_soon(stream.send_all, b"hello")
        await trio.testing.wait_all_tasks_blocked()
        assert bytes(carrier.sent) == b"hel"
        carrier.credit = 10
        stream.wake_writer()
    assert bytes(carrier.sent) == b"hello"
    assert stream.connection is carrier and stream.peer_id == "peer"


async def test_receive_some_waits_for_the_carriers_wake_up():
    carrier = Carrier()
    stream = MeshStream(carrier, 5, "x")
    got = []

    async def receive():
        got.append(await stream.receive_some())

    async with trio.open_nursery() as n:
        n.start_soon(receive)
        await trio.testing.wait_all_tasks_blocked()
        assert carrier.calls == [("read_until",)] and not got
        carrier.incoming.append(b"data")
        stream.wake_reader()
    assert got == [b"data"]


async def test_a_failed_stream_raises_its_error_both_ways():
    stream = MeshStream(Carrier(), 5, "x")
    error = StreamResetError(5, ErrorCode.CANCEL, "gone", by_peer=True)
    stream.fail(error)
    with pytest.raises(StreamResetError):
        await stream.receive_some()
    with pytest.raises(StreamResetError):
        await stream.send_all(b"x")


async def test_closing_resets_what_the_peer_still_sends_else_half_closes():
    carrier = Carrier()
    await MeshStream(carrier, 5, "x").aclose()
    assert carrier.calls == [
        ("reset_stream", 5, ErrorCode.CANCEL, "closed by the application"),
        ("forget_stream", 5),
    ]
    carrier = Carrier()
    carrier.remote_open = False
    await MeshStream(carrier, 7, "x").aclose()
    assert carrier.calls == [("send_eof", 7), ("forget_stream", 7)]
