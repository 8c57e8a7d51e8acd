"""A task waiting on a stream reads the socket itself while the connection's reader task is
idle (`net/reading.py`), over real loopback TCP: every byte still arrives in order on every
stream, a cancelled reader gives the reading back, and a bad record read by a stream's task
closes the connection like one read by the reader task."""

from __future__ import annotations

import pytest
import trio

from meshagent.net.errors import StreamResetError
from meshagent.wire.frames import DataFrame, OpenFrame, encode_frame
from tests.net.support import (
    NetEnv,
    hash_exchange,
    hash_reply,
    honest_handshake,
    local_peer,
    node,
    quick,
)

MESSAGE = 100


@pytest.fixture
def tcp() -> NetEnv:
    return NetEnv("tcp")


async def echo(stream) -> None:
    while data := await stream.receive_some():
        await stream.send_all(data)


async def serve(stream) -> None:
    if stream.label == "echo":
        await echo(stream)
    else:
        await hash_reply(stream)


async def test_round_trips_and_a_bulk_stream_share_a_connection_read_by_stream_tasks(tcp):
    config = quick(ping_interval=0.01)  # control frames arrive while streams read
    async with (
        trio.open_nursery() as nursery,
        node(tcp, "a", nursery, listen=False, config=config) as (a, _),
        node(tcp, "b", nursery, on_stream=serve, config=config) as (b, b_addr),
    ):
        with trio.fail_after(60):
            conn = await a.dial(b_addr, peer_id=b.peer_id)
            stream = await a.open_stream(b.peer_id, "echo")
            chunks = [bytes([i % 251]) * 65_536 for i in range(64)]

            async def bulk() -> None:
                await hash_exchange(await a.open_stream(b.peer_id, "bulk"), chunks)

            nursery.start_soon(bulk)
            for i in range(500):
                message = i.to_bytes(4, "big") * (MESSAGE // 4)
                await stream.send_all(message)
                got = b""
                while len(got) < MESSAGE:
                    got += await stream.receive_some()
                assert got == message
            await stream.send_eof()
            assert await stream.receive_some() == b""
        assert conn._input.turns > 100  # the round trips were read by this task
        served = b.connection(a.peer_id)
        assert served._input.turns > 100  # and by the echoing handler's
        assert not conn.is_closed
        nursery.cancel_scope.cancel()


async def test_a_cancelled_wait_gives_the_reading_back(tcp):
    async with (
        trio.open_nursery() as nursery,
        node(tcp, "a", nursery, listen=False) as (a, _),
        node(tcp, "b", nursery, on_stream=serve) as (b, b_addr),
    ):
        with trio.fail_after(30):
            conn = await a.dial(b_addr, peer_id=b.peer_id)
            quiet = await a.open_stream(b.peer_id, "echo")
            with trio.move_on_after(0.2) as scope:
                await quiet.receive_some()  # nothing comes: this task holds the reading
            assert scope.cancelled_caught
            assert conn._input.holder is None
            # The reader task reads again: another stream's reply arrives without any task
            # waiting on that stream while it comes.
            other = await a.open_stream(b.peer_id, "echo")
            await other.send_all(b"ping")
            await trio.sleep(0.2)
            assert conn.mux.read(other.stream_id, 100) == b"ping"
            await quiet.send_all(b"late")
            assert await quiet.receive_some() == b"late"
        nursery.cancel_scope.cancel()


async def test_a_bad_record_read_by_a_stream_task_closes_only_that_connection(tcp):
    waiting = trio.Event()
    failures: list[BaseException] = []

    async def handler(stream) -> None:
        if stream.label != "x":
            await hash_reply(stream)
            return
        waiting.set()
        try:
            await stream.receive_some()
        except StreamResetError as e:
            failures.append(e)

    async with (
        trio.open_nursery() as nursery,
        node(tcp, "b", nursery, on_stream=handler) as (
            b,
            b_addr,
        ),
    ):
        with trio.fail_after(30):
            raw, _, sealer = await honest_handshake(tcp, "mallory", b_addr, local_peer())
            await raw.send_all(sealer.seal(encode_frame(OpenFrame(1, 1 << 20, 64, "x"))))
            await waiting.wait()
            [conn] = b.connections()
            await trio.sleep(0.1)
            assert conn._input.holder is not None  # the handler's task reads
            record = bytearray(sealer.seal(encode_frame(DataFrame(1, b"hello"))))
            record[-1] ^= 1  # tampered: fails authentication
            await raw.send_all(bytes(record))
            await conn.wait_closed()
        assert "failed authentication" in conn.close_reason
        assert failures and "failed authentication" in str(failures[0])
        # The node serves the next peer as before.
        async with node(tcp, "a", nursery, listen=False) as (a, _):
            with trio.fail_after(30):
                await a.dial(b_addr, peer_id=b.peer_id)
                await hash_exchange(await a.open_stream(b.peer_id, "y"), [b"z" * 1000])
        nursery.cancel_scope.cancel()


async def test_a_reading_handler_sees_its_connection_end_as_a_reset_not_a_cancel(tcp):
    # A handler of the connection's own nursery that holds the reading when the connection
    # is dropped (a silent path, say) must get the reset, as it would waiting on its event:
    # a cancelled handler could not tell anyone its stream broke.
    outcome: list[str] = []
    reading = trio.Event()

    async def handler(stream) -> None:
        reading.set()
        try:
            await stream.receive_some()
            outcome.append("data")
        except StreamResetError as e:
            outcome.append(f"reset: {e.reason}")
        except trio.Cancelled:
            outcome.append("cancelled")
            raise

    async with (
        trio.open_nursery() as nursery,
        node(tcp, "a", nursery, listen=False) as (a, _),
        node(tcp, "b", nursery, on_stream=handler) as (b, b_addr),
    ):
        with trio.fail_after(30):
            await a.dial(b_addr, peer_id=b.peer_id)
            stream = await a.open_stream(b.peer_id, "x")
            await stream.send_all(b"")  # opens it at b
            await reading.wait()
            conn = b.connection(a.peer_id)
            await trio.sleep(0.1)
            assert conn._input.holder is not None
            conn.abort("no answer for 2.0 s on this path")
            await conn.wait_closed()
            while not outcome:
                await trio.sleep(0.01)
        assert outcome == ["reset: no answer for 2.0 s on this path"]
        nursery.cancel_scope.cancel()


async def test_a_stream_reset_or_closed_by_another_task_wakes_its_reader(tcp):
    quiet = quick(ping_interval=1000.0, dead_peer_timeout=None)  # nothing else arrives
    async with (
        trio.open_nursery() as nursery,
        node(tcp, "a", nursery, listen=False, config=quiet) as (a, _),
        node(tcp, "b", nursery, on_stream=serve, config=quiet) as (b, b_addr),
    ):
        with trio.fail_after(30):
            conn = await a.dial(b_addr, peer_id=b.peer_id)
            for how, error in (("reset", StreamResetError), ("close", trio.ClosedResourceError)):
                stream = await a.open_stream(b.peer_id, "echo")
                raised = []

                async def read(stream=stream, raised=raised) -> None:
                    try:
                        await stream.receive_some()
                    except Exception as e:
                        raised.append(e)

                async with trio.open_nursery() as inner:
                    inner.start_soon(read)
                    await trio.sleep(0.1)
                    assert conn._input.holder is stream
                    with trio.fail_after(1):  # woken now, not by the next bytes to arrive
                        if how == "reset":
                            stream.reset("given up")
                        else:
                            await stream.aclose()
                        while not raised:
                            await trio.sleep(0.01)
                assert len(raised) == 1 and isinstance(raised[0], error), (how, raised)
            await hash_exchange(await a.open_stream(b.peer_id, "y"), [b"z" * 1000])  # still up
            assert not conn.is_closed
        nursery.cancel_scope.cancel()
