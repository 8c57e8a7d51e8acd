"""A relay tells an agent where it sees it come from, on its main port and its observing
port; the agent dials both from the port it listens on (real loopback TCP)."""

from __future__ import annotations

import pytest
import trio

from meshagent.discovery import nat
from meshagent.errors import ConfigError
from meshagent.identity.keys import NodeIdentity
from meshagent.net.address import Address
from meshagent.net.manager import ConnectionManager, LocalPeer
from meshagent.net.tcp import TcpTransport
from meshagent.relay.client import RelayClient
from meshagent.relay.server import RelayServer
from tests.relay.support import MESH


async def test_the_relay_sees_the_agent_at_its_listen_port_from_both_ports():
    seen: list[nat.Observation] = []
    async with trio.open_nursery() as nursery:
        server = RelayServer(TcpTransport(), "127.0.0.1:0", observe="127.0.0.1:0")
        relay = await nursery.start(server.run)
        assert server.observe_address is not None and server.observe_address != relay
        identity = NodeIdentity.generate()
        overlay = ConnectionManager(
            LocalPeer.create(identity, MESH), TcpTransport(), listen=["127.0.0.1:0"]
        )
        [listen] = await nursery.start(overlay.run)
        client = RelayClient(
            relay, identity, MESH, overlay, TcpTransport(), on_observed=seen.append
        )
        await nursery.start(client.run)
        with trio.fail_after(10):
            while len(seen) < 2:
                await trio.sleep(0.01)
        assert {o.observer for o in seen} == {relay, server.observe_address}
        assert all(o.seen == Address("127.0.0.1", listen.port) for o in seen)
        assert client.observed == Address("127.0.0.1", listen.port)
        observations = nat.Observations(own_hosts=lambda: ["127.0.0.1"])
        for o in seen:
            observations.add(o)
        assert observations.reachability(listen.port).nat == nat.NONE
        nursery.cancel_scope.cancel()


async def test_a_second_listener_cannot_take_a_shared_port():
    # Listeners share their port with connections dialed from it, not with another agent.
    async with trio.open_nursery() as nursery:
        first = await nursery.start(TcpTransport().serve, Address("127.0.0.1", 0), _ignore)
        with pytest.raises(ConfigError, match="already in use"), trio.fail_after(5):
            await nursery.start(TcpTransport().serve, first, _ignore)
        nursery.cancel_scope.cancel()


async def _ignore(stream: trio.abc.Stream) -> None:
    await stream.aclose()
