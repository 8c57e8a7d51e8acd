"""A cancelled send must never corrupt the record stream: every sealed record consumes a
nonce, so a write cut short would make everything after it undecryptable."""

import trio

from meshagent.wire.frames import DataFrame, FrameDecoder
from meshagent.wire.sealed_records import RecordReader
from tests.net.support import honest_handshake, local_peer, node, quick

MIB = 1 << 20


def pattern(n: int) -> bytes:
    return bytes(i % 251 for i in range(n))


async def test_cancelled_send_to_a_stalled_peer_leaves_the_connection_intact(env, clock):
    # The peer reads nothing from its socket, so every buffer on the way fills up and the
    # sender blocks in the middle of a write; then the application gives up on that send.
    stalled = local_peer(window_bytes=64 * MIB, window_frames=4096)
    blob = pattern(MIB)
    # No pings: the application's own (inline) write is the one that blocks and is cut.
    config = quick(ping_interval=1000.0, dead_peer_timeout=None)
    async with trio.open_nursery() as nursery, node(env, "b", nursery, config=config) as (b, addr):
        raw, result, _ = await honest_handshake(env, "z", addr, stalled)
        with trio.fail_after(60):
            conn = await b.wait_connected(stalled.peer_id)
            bulk = await b.open_stream(stalled.peer_id, "bulk")
            await trio.sleep(0.1)  # let the writer task send OPEN and go idle
            accepted = 0
            with trio.move_on_after(0.5) as scope:
                for _ in range(64):
                    await bulk.send_all(blob)
                    accepted += MIB
            assert scope.cancelled_caught and accepted < 64 * MIB, accepted
            assert conn._writer_state.has_pending  # the cancelled write stopped part-way
            assert not conn.is_closed
            marker = await b.open_stream(stalled.peer_id, "marker")
            # Queued behind the rest of the cancelled write, which goes out as the peer reads.
            nursery.start_soon(marker.send_all, b"END")

            # Now read everything the stalled peer was sent: every record must decrypt, and
            # the bulk bytes must be an in-order prefix of what the application sent.
            decoder = FrameDecoder(RecordReader(result.recv_key, result.cipher))
            received = {bulk.stream_id: bytearray(), marker.stream_id: bytearray()}
            while bytes(received[marker.stream_id]) != b"END":
                data = await raw.receive_some(1 << 16)
                assert data, "the connection was closed"
                decoder.receive_data(data)
                while (frame := decoder.next_frame()) is not None:
                    if isinstance(frame, DataFrame):
                        received[frame.stream_id] += frame.payload
        got = bytes(received[bulk.stream_id])
        assert accepted <= len(got) <= accepted + MIB
        assert got == (blob * (len(got) // MIB + 1))[: len(got)]
        await trio.aclose_forcefully(raw)
        nursery.cancel_scope.cancel()
