"""Acceptance 3: a receiver that stops reading makes its sender wait, for as long as it
takes; nothing is reset, buffering stays within the window, every byte arrives in order."""

import random

import trio

from meshagent.testing.sim_network import LinkSpec
from tests.net.support import NetEnv, local_peer, node

WINDOW = 256 * 1024
CHUNK = 64 * 1024


async def test_stalled_receiver_makes_the_sender_wait_without_reset(env, clock):
    stall = 60.0 if env.kind == "sim" else 0.5  # simulated seconds cost nothing
    if env.kind == "sim":  # a 150 ms RTT, 50 MB/s link
        env = NetEnv("sim", LinkSpec(latency=0.075, bandwidth=50e6))
    payload = random.Random(3).randbytes(4 << 20)
    received = bytearray()
    stalled, resumed = trio.Event(), trio.Event()
    samples: list[tuple[float, int, int]] = []

    async def slow_reader(stream):
        received.extend(await stream.receive_some(CHUNK))
        stalled.set()
        await trio.sleep(stall)  # the application is busy; the overlay must not care
        resumed.set()
        while data := await stream.receive_some(CHUNK):
            received.extend(data)
        await stream.send_all(b"all read")
        await stream.send_eof()

    receiver = local_peer(window_bytes=WINDOW, window_frames=16)
    async with (
        trio.open_nursery() as nursery,
        node(env, "b", nursery, local=receiver, on_stream=slow_reader) as (b, b_addr),
        node(env, "a", nursery, listen=False) as (a, _),
    ):
        conn = await a.dial(b_addr, peer_id=b.peer_id)
        stream = await a.open_stream(b.peer_id, "activations")
        sent = 0

        async def sender():
            nonlocal sent
            for i in range(0, len(payload), CHUNK):
                await stream.send_all(payload[i : i + CHUNK])
                sent += CHUNK
            await stream.send_eof()

        with trio.fail_after(stall + 120):
            nursery.start_soon(sender)
            await stalled.wait()
            pings_before = conn.rtt.samples
            server_conn = b.connection(a.peer_id)
            while not resumed.is_set():
                # The sender has handed over no more than the receiver read plus one window.
                assert sent - len(received) <= WINDOW
                assert server_conn.mux.buffered(stream.stream_id) <= WINDOW
                assert sent < len(payload), "the sender should be held back"
                assert not conn.is_closed and stream._error is None
                samples.append((trio.current_time(), sent, len(received)))
                await trio.sleep(stall / 20)
            if env.kind == "sim":
                # PINGs kept flowing while the application was stalled: alive, not slow.
                assert conn.rtt.samples >= pings_before + 10
                assert 0.150 <= conn.rtt.latest < 0.3
            reply = b""
            while data := await stream.receive_some():
                reply += data
        assert reply == b"all read"
        assert bytes(received) == payload  # every byte, in order
        # The sender really was waiting: its progress froze during the stall.
        assert len(samples) >= 15
        assert samples[1][1] == samples[-1][1] and samples[1][2] == samples[-1][2]
        nursery.cancel_scope.cancel()
