"""`header/1` with a peer that lies: a map whose end or gaps do not fit a header is refused
where it is decoded (`HeaderShareError`), over a real overlay connection and for any values
a peer may send; a server answers any request, however malformed, or refuses it."""

from __future__ import annotations

from typing import Any

import cbor2
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret
from meshagent.models import header_share
from meshagent.models.files import file_sha256
from meshagent.models.header_map import HeaderMap
from meshagent.models.header_share import LABEL, HeaderMapServer, HeaderShareError, ask
from meshagent.net.manager import ConnectionManager
from meshagent.net.tcp import TcpTransport
from meshagent.testing.tiny_gguf import write_tiny_model
from meshagent.wire.framing import LengthPrefixDecoder
from meshagent.wire.handshake import LocalPeer
from tests.net.scripted import ScriptedStream

SHA = "ab" * 32
MESH = MeshSecret.generate()
GiB = 1 << 30


def answer(**fields: Any) -> bytes:
    keys = {"end": header_share.K_END, "gaps": header_share.K_GAPS, "error": header_share.K_ERROR}
    body = {header_share.K_VERSION: header_share.VERSION}
    body |= {keys[k]: v for k, v in fields.items()}
    return header_share.FRAMING.encode(cbor2.dumps(body))


async def asked(reply: bytes) -> HeaderMap:
    stream = ScriptedStream(reply)

    async def open_stream() -> ScriptedStream:
        return stream

    return await ask(open_stream, SHA)


async def test_an_honest_map_is_taken():
    got = await asked(answer(end=5000, gaps=[[100, 900, 3], [900, 1000, 1], [2000, 2100, 2]]))
    assert got == HeaderMap(SHA, 5000, ((100, 900, 3), (900, 1000, 1), (2000, 2100, 2)))


@pytest.mark.parametrize(
    ("end", "gaps"),
    [
        (0, []),
        (-1, []),
        (True, []),
        (GiB + 1, []),  # no model's header is that large
        (2**70, []),
        (5000, [[-5, 10, 1]]),
        (5000, [[10, 5, 1]]),  # ends before it starts
        (5000, [[10, 10, 1]]),  # holds nothing
        (5000, [[10, 20, 0]]),  # no entry
        (5000, [[10, 20, 11]]),  # more entries than bytes
        (5000, [[10, 6000, 1]]),  # past the header's end
        (5000, [[100, 200, 1], [150, 300, 1]]),  # overlapping
        (5000, [[300, 400, 1], [100, 200, 1]]),  # out of order
        (5000, [[10, 20, True]]),
        (5000, [[10, 20]]),
        (5000, [[10, 20, 1]] * 65),  # more than MAX_GAPS
    ],
)
async def test_a_map_that_fits_no_header_is_refused(end, gaps):
    with pytest.raises(HeaderShareError):
        await asked(answer(end=end, gaps=gaps))


# Integers past the 4300 digits Python prints (a CBOR bignum of some 2 KB): quoted with repr()
# or str() they raise ValueError, not the protocol's error.
huge = st.integers(4400, 5000).map(lambda n: 10**n)
wide = st.one_of(huge, huge.map(lambda v: -v))

wire_values = st.one_of(
    st.integers(-(2**70), 2**70),
    wide,
    st.booleans(),
    st.none(),
    st.floats(),
    st.text(max_size=10),
    st.lists(st.integers(-(2**40), 2**40), max_size=4),
)


@settings(max_examples=300)
@given(
    st.one_of(st.integers(-(2**70), 2**70), wire_values),
    st.one_of(
        st.lists(st.lists(wire_values, max_size=4), max_size=6),
        # one gap of one wide value among fitting ones
        st.tuples(st.integers(0, 2), wide).map(
            lambda a: [[a[1] if i == a[0] else x for i, x in enumerate([10, 20, 1])]]
        ),
        wire_values,
    ),
)
async def test_any_answer_is_a_map_that_fits_or_refused(end, gaps):
    try:
        got = await asked(answer(end=end, gaps=gaps))
    except HeaderShareError:
        return
    assert 0 < got.end <= GiB
    after = 0
    for start, stop, count in got.gaps:
        assert after <= start < stop <= got.end and 0 < count <= stop - start
        after = stop


@settings(max_examples=30)
@given(st.one_of(wide, wire_values))
async def test_a_peer_with_no_map_is_refused_with_its_reason_whatever_it_is(why):
    with pytest.raises(HeaderShareError):
        await asked(answer(error=why))


async def test_a_lying_peer_over_the_overlay_gives_no_map(nursery):
    async def liar(stream) -> None:
        await stream.receive_some()
        await stream.send_all(answer(end=2**64, gaps=[[5, 2, 0]]))
        await stream.send_eof()

    server = ConnectionManager(
        LocalPeer.create(NodeIdentity.generate(), MESH),
        TcpTransport(),
        listen=["127.0.0.1:0"],
        on_stream=liar,
    )
    addresses = await nursery.start(server.run)
    asker = ConnectionManager(LocalPeer.create(NodeIdentity.generate(), MESH), TcpTransport())
    await nursery.start(asker.run)
    conn = await asker.dial(addresses[0], peer_id=server.peer_id)
    with trio.fail_after(10), pytest.raises(HeaderShareError, match="end"):
        await ask(lambda: conn.open_stream(LABEL), SHA)


# ----- the server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", "llama", n_layers=2)
    return path, file_sha256(path)


def reply_of(stream: ScriptedStream) -> dict[int, Any]:
    body = LengthPrefixDecoder(header_share.FRAMING, bytes(stream.sent)).next_frame()
    assert body is not None
    return cbor2.loads(body)


def request(fields: dict[int, Any]) -> bytes:
    return header_share.FRAMING.encode(cbor2.dumps(fields))


async def test_the_server_answers_its_file_and_refuses_what_is_no_sha256(tiny):
    path, sha = tiny
    server = HeaderMapServer.of(path, lambda: sha)
    stream = ScriptedStream(request({0: 1, 1: sha}))
    await server.handle(stream)
    assert header_share.K_END in reply_of(stream)
    for bad in ("zz" * 32, sha.upper(), sha[:63], 7, None):
        stream = ScriptedStream(request({0: 1, 1: bad}))
        await server.handle(stream)
        assert header_share.K_ERROR in reply_of(stream)


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.integers(0, 5), st.one_of(wire_values, st.just("ab" * 32))))
async def test_any_request_is_answered_never_raised(tiny, fields):
    path, sha = tiny
    stream = ScriptedStream(request(fields))
    await HeaderMapServer.of(path, lambda: sha).handle(stream)  # raises nothing
    if stream.sent:
        assert set(reply_of(stream)) & {header_share.K_END, header_share.K_ERROR}
