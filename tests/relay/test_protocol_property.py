"""The relay protocol with generated values for every field: `decode` and the readers of each
message type refuse a value out of range with a RelayError naming it, and nothing else comes
out; a relay server facing anyone on the network, and a relay client facing a relay, end the
one connection that sent it and keep serving."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import cbor2
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.identity.keys import NodeIdentity
from meshagent.net.address import Address
from meshagent.relay import protocol as p
from meshagent.relay.errors import Refusal, RelayError, RelayProtocolError, RelayRefused
from meshagent.wire.framing import LengthPrefixDecoder
from tests.peer_values import not_an_int, outside, wide_ints
from tests.relay.support import MESH, start_agent, start_relay

TYPES = range(p.HELLO, p.PONG + 1)
CODES = range(min(Refusal), max(Refusal) + 1)


def body(fields: dict[Any, Any]) -> bytes:
    return cbor2.dumps(fields)


# ----- decode: version and type ---------------------------------------------------------


@given(outside(range(1, 2)))
def test_a_version_out_of_range_is_refused_naming_it(version):
    with pytest.raises(RelayRefused, match="version") as info:
        p.decode(body({0: version, 1: p.PING}))
    assert info.value.code is Refusal.VERSION


@given(outside(TYPES))
def test_a_type_out_of_range_is_refused_naming_it(kind):
    with pytest.raises(RelayProtocolError, match="type"):
        p.decode(body({0: 1, 1: kind}))


@pytest.mark.parametrize("kind", TYPES)
def test_every_type_decodes(kind):
    assert p.decode(body({0: 1, 1: kind})).type == kind


cbor_values = st.recursive(
    st.one_of(
        st.integers(-(2**70), 2**70),
        wide_ints,
        st.binary(max_size=40),
        st.text(max_size=40),
        st.booleans(),
        st.none(),
        st.floats(),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.integers(0, 5), inner, max_size=4)
    ),
    max_leaves=12,
)
maps = st.dictionaries(st.integers(0, 5), cbor_values, max_size=6)
message_maps = st.builds(
    lambda kind, rest: {**rest, 0: 1, 1: kind}, st.sampled_from(list(TYPES)), maps
)


def read_all_fields(msg: p.Message) -> None:
    """What the relay server and client read of a message of its type."""
    if msg.type in (p.REGISTER, p.CONNECT, p.ACCEPT):
        p.verify_request(msg, bytes(p.NONCE_LEN))
    elif msg.type == p.HELLO:
        p.hello_nonce(msg)
        p.hello_observed(msg)
        p.hello_observe_port(msg)
    elif msg.type in (p.REGISTERED, p.MEMBERS):
        p.peer_list(msg)
    elif msg.type == p.INCOMING:
        p.incoming_circuit(msg)
    elif msg.type == p.REFUSED:
        p.raise_if_refused(msg)


@settings(max_examples=400)
@given(st.one_of(maps, message_maps))
def test_any_map_is_read_or_a_relay_error(fields):
    with contextlib.suppress(RelayError):
        read_all_fields(p.decode(body(fields)))


@settings(max_examples=300)
@given(st.binary(max_size=100))
def test_any_bytes_are_read_or_a_relay_error(data):
    with contextlib.suppress(RelayError):
        read_all_fields(p.decode(data))


# ----- each type's fields -----------------------------------------------------------------


@given(outside(CODES))
def test_a_refusal_code_out_of_range_is_a_protocol_error_naming_it(code):
    msg = p.decode(body({0: 1, 1: p.REFUSED, 2: code, 3: "no"}))
    with pytest.raises(RelayProtocolError, match="code"):
        p.raise_if_refused(msg)


@pytest.mark.parametrize("code", list(Refusal))
def test_every_refusal_code_is_raised_as_itself(code):
    with pytest.raises(RelayRefused) as info:
        p.raise_if_refused(p.decode(p.refused(code, "why").encode()[2:]))
    assert info.value.code is code and info.value.reason == "why"


def fixed_bytes(size: int) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.integers(-(2**70), 2**70),
        wide_ints,
        not_an_int.filter(lambda v: not isinstance(v, bytes)),
        st.binary(max_size=2 * size).filter(lambda b: len(b) != size),
    )


peer_ids = st.one_of(
    st.integers(-(2**70), 2**70),
    wide_ints,
    not_an_int.filter(lambda v: not isinstance(v, str)),
    st.text(min_size=65, max_size=100),
)


@given(fixed_bytes(p.NONCE_LEN))
def test_a_hello_nonce_out_of_range_is_refused_naming_it(nonce):
    with pytest.raises(RelayProtocolError, match="HELLO field 2"):
        p.hello_nonce(p.decode(body({0: 1, 1: p.HELLO, 2: nonce})))


@given(
    st.one_of(fixed_bytes(16).map(lambda c: (c, "peer")), peer_ids.map(lambda f: (b"c" * 16, f)))
)
def test_an_incoming_field_out_of_range_is_refused_naming_it(fields):
    circuit, from_peer = fields
    msg = p.decode(body({0: 1, 1: p.INCOMING, 2: circuit, 3: from_peer}))
    with pytest.raises(RelayProtocolError, match=r"INCOMING field [23]"):
        p.incoming_circuit(msg)


@given(st.one_of(peer_ids.map(lambda x: [x]), st.just(["p"] * (p.MAX_MEMBERS_LISTED + 1))))
def test_a_member_list_out_of_range_is_refused_naming_it(peers):
    with pytest.raises(RelayProtocolError, match="MEMBERS"):
        p.peer_list(p.decode(body({0: 1, 1: p.MEMBERS, 2: peers})))


@given(
    st.sampled_from([p.REGISTER, p.CONNECT, p.ACCEPT]),
    st.one_of(
        fixed_bytes(32).map(lambda v: {2: v}),
        fixed_bytes(64).map(lambda v: {3: v}),
        st.one_of(
            st.integers(-(2**70), 2**70), wide_ints, st.binary(min_size=257, max_size=300)
        ).map(lambda v: {4: v}),
    ),
)
def test_a_request_field_out_of_range_is_refused_naming_it(kind, bad):
    good = p.register(NodeIdentity.generate(), bytes(p.NONCE_LEN), b"t" * 32).fields
    msg = p.decode(body({0: 1, 1: kind, **good, **bad}))
    (key,) = bad
    with pytest.raises(RelayProtocolError, match=f"field {key}"):
        p.verify_request(msg, bytes(p.NONCE_LEN))


# ----- a relay server facing anyone ---------------------------------------------------------

BAD_VALUES = [-1, 0, 12, 2**64, 10**5000, True, 1.0, "1", b"\x01", None, [1]]


def first_messages() -> list[tuple[str, Callable[[NodeIdentity, bytes], dict[Any, Any]]]]:
    """(name, a first message with one field out of range, given the key and nonce)."""
    cases: list[tuple[str, Callable[[NodeIdentity, bytes], dict[Any, Any]]]] = []
    for i, v in enumerate(BAD_VALUES):
        cases.append((f"version-{i}", lambda me, nonce, v=v: {0: v, 1: p.REGISTER}))
        cases.append((f"type-{i}", lambda me, nonce, v=v: {0: 1, 1: v}))
        for key in (2, 3, 4):
            cases.append(
                (
                    f"register-field{key}-{i}",
                    lambda me, nonce, v=v, key=key: {
                        0: 1,
                        1: p.REGISTER,
                        **p.register(me, nonce, p.rendezvous_tag(MESH)).fields,
                        key: v,
                    },
                )
            )
    return cases


async def raw_connection(env, relay: Address):
    """A connection to the relay that has read its HELLO: (stream, frames, nonce)."""
    stream = await env.transport("raw").dial(relay)
    frames = LengthPrefixDecoder(p.FRAMING)
    while (hello := frames.next_frame()) is None:
        frames.feed(await stream.receive_some(4096))
    return stream, frames, p.decode(hello).get(2, bytes, size=p.NONCE_LEN)


async def answer(stream, frames) -> p.Message | None:
    """The relay's next message; None if it closed the connection."""
    while (data := frames.next_frame()) is None:
        try:
            more = await stream.receive_some(4096)
        except trio.BrokenResourceError:
            return None
        if not more:
            return None
        frames.feed(more)
    return p.decode(data)


async def still_serves(env, nursery, relay: Address) -> None:
    a = await start_agent(env, nursery, "a", relay)
    b = await start_agent(env, nursery, "b", relay)
    with trio.fail_after(30):
        conn = await a.client.dial(b.peer_id)
    assert conn.peer_id == b.peer_id


@pytest.mark.parametrize(
    "craft", [c for _, c in first_messages()], ids=[name for name, _ in first_messages()]
)
async def test_a_first_message_out_of_range_is_refused_and_the_relay_serves_on(
    sim_env, autojump_clock, craft
):
    async with trio.open_nursery() as nursery:
        server, relay, _ = await start_relay(sim_env, nursery)
        stream, frames, nonce = await raw_connection(sim_env, relay)
        await stream.send_all(p.FRAMING.encode(body(craft(NodeIdentity.generate(), nonce))))
        reply = await answer(stream, frames)
        assert reply is not None and reply.type == p.REFUSED, reply
        assert sum(server.refusals.values()) == 1
        await still_serves(sim_env, nursery, relay)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("bad", [{0: 10**5000}, {1: 10**5000}, {1: True}, {1: p.HELLO}, {1: 99}])
async def test_a_control_message_out_of_range_ends_that_registration_only(
    sim_env, autojump_clock, bad
):
    async with trio.open_nursery() as nursery:
        _server, relay, _ = await start_relay(sim_env, nursery)
        stream, frames, nonce = await raw_connection(sim_env, relay)
        me = NodeIdentity.generate()
        await stream.send_all(p.register(me, nonce, p.rendezvous_tag(MESH)).encode())
        registered = await answer(stream, frames)
        assert registered is not None and registered.type == p.REGISTERED
        await stream.send_all(p.FRAMING.encode(body({0: 1, 1: p.PING, **bad})))
        reply = await answer(stream, frames)
        assert reply is not None and reply.type == p.REFUSED, reply
        await still_serves(sim_env, nursery, relay)
        nursery.cancel_scope.cancel()


# ----- a relay client facing a relay --------------------------------------------------------

NONCE = bytes(range(p.NONCE_LEN))


def relay_says(*messages: dict[Any, Any]):
    """A fake relay: HELLO, then after the client's first message each of `messages`, then
    silence until the client goes."""

    async def handle(stream: trio.abc.Stream) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(p.hello(NONCE).encode())
            await stream.receive_some(4096)
            for m in messages:
                await stream.send_all(p.FRAMING.encode(body(m)))
            while await stream.receive_some(4096):
                pass

    return handle


REGISTERED = {0: 1, 1: p.REGISTERED, 2: []}
CLIENT_CASES = [
    ("hello-version", [], {0: 10**5000, 1: p.HELLO, 2: NONCE}, "version"),
    ("hello-observed", [], {0: 1, 1: p.HELLO, 2: NONCE, 4: "no port"}, "observed address"),
    ("hello-observed", [], {0: 1, 1: p.HELLO, 2: NONCE, 4: 7}, "HELLO field 4"),
    ("hello-observe-port", [], {0: 1, 1: p.HELLO, 2: NONCE, 5: 70000}, "observe port"),
    ("hello-observe-port", [], {0: 1, 1: p.HELLO, 2: NONCE, 5: "9340"}, "HELLO field 5"),
    *(("reply-type", [], {0: 1, 1: v}, "type") for v in BAD_VALUES),
    *(("reply-version", [], {0: v, 1: p.REGISTERED, 2: []}, "version") for v in BAD_VALUES),
    *(("refused-code", [], {0: 1, 1: p.REFUSED, 2: v, 3: "no"}, "code") for v in BAD_VALUES),
    ("registered-list", [], {0: 1, 1: p.REGISTERED, 2: [10**5000]}, "REGISTERED"),
    ("registered-list", [], {0: 1, 1: p.REGISTERED, 2: 5}, "REGISTERED field 2"),
    ("members-list", [REGISTERED], {0: 1, 1: p.MEMBERS, 2: ["x" * 65]}, "MEMBERS"),
    ("incoming-circuit", [REGISTERED], {0: 1, 1: p.INCOMING, 2: 2**64, 3: "b"}, "field 2"),
    ("incoming-peer", [REGISTERED], {0: 1, 1: p.INCOMING, 2: b"c" * 16, 3: 10**5000}, "field 3"),
    ("control-type", [REGISTERED], {0: 1, 1: 10**5000}, "type"),
]


@pytest.mark.parametrize(
    ("before", "bad", "named"),
    [c[1:] for c in CLIENT_CASES],
    ids=[f"{c[0]}-{i}" for i, c in enumerate(CLIENT_CASES)],
)
async def test_a_relay_message_out_of_range_ends_that_session_not_the_client(
    sim_env, autojump_clock, before, bad, named
):
    async with trio.open_nursery() as nursery:
        first = bad if bad.get(1) == p.HELLO else None
        handle = relay_says(*before, bad) if first is None else _hello_only(first)
        relay = await nursery.start(
            sim_env.transport("relay").serve, Address.parse("relay:0"), handle
        )
        agent = await start_agent(sim_env, nursery, "a", relay, register=False)
        await nursery.start(agent.client.run)
        with trio.fail_after(30):
            while agent.client.last_error is None:
                await trio.sleep(0.1)
        assert named in agent.client.last_error
        nursery.cancel_scope.cancel()


def _hello_only(hello: dict[Any, Any]):
    async def handle(stream: trio.abc.Stream) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(p.FRAMING.encode(body(hello)))
            while await stream.receive_some(4096):
                pass

    return handle


async def test_a_relay_that_closes_a_registration_ends_that_session_not_the_client(
    sim_env, autojump_clock
):
    """What ends a registered session (here the relay closing it) ends that session only."""
    sessions = []

    async def handle(stream: trio.abc.Stream) -> None:
        sessions.append(stream)
        await stream.send_all(p.hello(NONCE).encode())
        await stream.receive_some(4096)
        await stream.send_all(p.registered([]).encode())
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        relay = await nursery.start(
            sim_env.transport("relay").serve, Address.parse("relay:0"), handle
        )
        agent = await start_agent(sim_env, nursery, "a", relay, register=False)
        await nursery.start(agent.client.run)
        with trio.fail_after(60):
            while len(sessions) < 3:  # it registers again, and again
                await trio.sleep(0.1)
        assert agent.client.last_error == "the relay closed the connection"
        nursery.cancel_scope.cancel()
