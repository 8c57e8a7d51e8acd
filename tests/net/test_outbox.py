"""Outbox: sends put from synchronous code on the event loop arrive whole and in order, also
when the peer's credit runs out and the rest must wait; a broken stream is reported once."""

import random

import trio
import trio.testing

from meshagent.net.outbox import Outbox
from tests.net.support import local_peer, node, read_all

WINDOW = 64 * 1024


async def test_puts_arrive_in_order_past_the_window(env, clock):
    rng = random.Random(7)
    # Small messages the window takes at once, then more than it holds while the receiver
    # sleeps: those must wait for credit, behind nothing and ahead of nothing.
    messages = [rng.randbytes(rng.randrange(1, 3000)) for _ in range(200)]
    messages += [rng.randbytes(40_000) for _ in range(8)]
    got = trio.Event()
    received: list[bytes] = []

    async def reader(stream):
        await trio.sleep(1.0)  # let the window fill first
        received.append(await read_all(stream))
        got.set()

    async with (
        trio.open_nursery() as nursery,
        node(env, "b", nursery, local=local_peer(window_bytes=WINDOW), on_stream=reader) as (
            b,
            b_addr,
        ),
        node(env, "a", nursery, listen=False) as (a, _),
    ):
        await a.dial(b_addr, peer_id=b.peer_id)
        stream = await a.open_stream(b.peer_id, "outbox")
        errors: list[BaseException] = []
        outbox = Outbox(stream, nursery, errors.append)
        for m in messages:
            outbox.put(m)
        await outbox.flush()
        await stream.send_eof()
        with trio.fail_after(60):
            await got.wait()
        assert errors == []
        assert received == [b"".join(messages)]
        nursery.cancel_scope.cancel()


async def test_a_broken_stream_is_reported_once_and_later_puts_are_dropped():
    a, b = trio.testing.memory_stream_pair()
    errors: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        outbox = Outbox(a, nursery, errors.append)
        await b.aclose()
        outbox.put(b"first")
        await outbox.flush()
        outbox.put(b"second")
        await outbox.flush()
    assert len(errors) == 1
    assert isinstance(errors[0], trio.BrokenResourceError)
    assert outbox.failed is errors[0]


async def test_a_stream_without_send_nowait_goes_through_the_task_in_order():
    a, b = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        outbox = Outbox(a, nursery, lambda e: None)
        for i in range(50):
            outbox.put(b"%d," % i)
        await outbox.flush()
        await a.send_eof()
        data = await read_all(b)
    assert data == b"".join(b"%d," % i for i in range(50))
