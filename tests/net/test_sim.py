"""The simulated network honours latency, bandwidth and loss, on a virtual clock."""

import pytest
import trio

from meshagent.net.address import Address
from meshagent.testing.sim_network import LinkSpec, SimNetwork
from tests.net.support import NetEnv, hash_exchange, node, read_all


async def serve_once(net: SimNetwork, address: Address, handler, nursery):
    return await nursery.start(net.transport(address.host).serve, address, handler)


async def test_latency_bandwidth_and_order(autojump_clock):
    net = SimNetwork(default=LinkSpec(latency=0.075, bandwidth=10e6))
    received = []

    async def sink(stream):
        received.append((await read_all(stream), trio.current_time()))

    async with trio.open_nursery() as nursery:
        addr = await serve_once(net, Address("b", 1), sink, nursery)
        start = trio.current_time()
        client = await net.transport("a").dial(addr)
        assert trio.current_time() - start == pytest.approx(0.150)  # connect: one round trip
        payload = bytes(range(256)) * 40_000  # ~10 MB at 10 MB/s
        sent_at = trio.current_time()
        await client.send_all(payload)
        await client.send_eof()
        while not received:
            await trio.sleep(0.01)
        data, done = received[0]
        assert data == payload
        assert done - sent_at == pytest.approx(len(payload) / 10e6 + 0.075, rel=0.02)
        nursery.cancel_scope.cancel()


async def test_loss_delays_but_never_corrupts(autojump_clock):
    lossy = LinkSpec(latency=0.010, loss=0.3, retransmit_delay=0.2, segment=1000)
    net = SimNetwork(default=lossy, seed=42)
    received = []

    async def sink(stream):
        received.append(await read_all(stream))

    async with trio.open_nursery() as nursery:
        addr = await serve_once(net, Address("b", 1), sink, nursery)
        client = await net.transport("a").dial(addr)
        start = trio.current_time()
        payload = bytes(i % 253 for i in range(100_000))  # 100 segments, ~30 lost
        await client.send_all(payload)
        await client.send_eof()
        while not received:
            await trio.sleep(0.01)
        assert received[0] == payload
        assert trio.current_time() - start > 0.2  # retransmissions cost time
        nursery.cancel_scope.cancel()


async def test_dialing_an_address_nobody_listens_on_is_refused(autojump_clock):
    with pytest.raises(OSError, match="refused"):
        await SimNetwork().transport("a").dial(Address("b", 9))


async def test_the_overlay_measures_a_150_ms_rtt_in_virtual_time(autojump_clock):
    env = NetEnv("sim", LinkSpec(latency=0.075))
    async with (
        trio.open_nursery() as nursery,
        node(env, "b", nursery) as (b, addr),
        node(env, "a", nursery, listen=False) as (a, _),
    ):
        conn = await a.dial(addr)
        await hash_exchange(await a.open_stream(b.peer_id), [b"x" * 100_000])
        await trio.sleep(30)
        assert conn.rtt.samples >= 5
        assert conn.rtt.latest == pytest.approx(0.150, abs=0.005)
        assert conn.rtt.smoothed == pytest.approx(0.150, abs=0.005)
        nursery.cancel_scope.cancel()
