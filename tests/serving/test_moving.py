"""A split's streams move with their connection (`serving/moving.py`): over real loopback
connections, every connection of a fake three-stage chain is replaced while a request runs
(a second connection between the same two peers wins, the first drains), and the request
goes on over the new ones: the same text as the whole model's, no break, no replay, and the
old connections close long before the request ends, once nothing is open on them."""

from __future__ import annotations

from functools import partial

import pytest
import structlog
import trio

from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret
from meshagent.net.config import OverlayConfig
from meshagent.net.manager import ConnectionManager
from meshagent.net.tcp import TcpTransport
from meshagent.serving import stage_messages as sm
from meshagent.serving.local_model import LocalModel
from meshagent.serving.moving import Handover, MovingReader
from meshagent.serving.pipeline import REPLY_LABEL, STAGE_LABEL, PipelineExecutor
from meshagent.serving.runner import ModelRunner
from meshagent.testing.fake_engine import FakeEngine, FakeEntry, FakeStage
from meshagent.wire.handshake import LocalPeer
from tests.serving.stages import fake_server, upstream_decoder
from tests.serving.test_runner import complete

MESH = MeshSecret.generate()
TOKENS = 120
# Longer than the whole request: a stream that stayed on its old connection would keep it
# open to the end, so an old connection that closes early shows its streams left it.
GRACE = 60.0


class Ring:
    """Three overlay nodes on loopback and a fake chain over them: the entry on node 0, a
    middle stage on node 1, the last stage on node 2 (replying to node 0)."""

    def __init__(self, delay: float) -> None:
        config = OverlayConfig(drain_grace=GRACE)
        self.nodes = [
            ConnectionManager(
                LocalPeer.create(NodeIdentity.generate(), MESH),
                TcpTransport(),
                listen=["127.0.0.1:0"],
                config=config,
            )
            for _ in range(3)
        ]
        self.ids = [n.peer_id for n in self.nodes]
        self.entry = FakeEntry(delay=delay)
        self.stages = [FakeStage(last=False, delay=delay), FakeStage(last=True, delay=delay)]
        self.pipeline = PipelineExecutor(
            self.entry, lambda: self._open(0, 1, STAGE_LABEL), wire_dtype="f32", depth=3
        )
        self.servers = [
            fake_server(self.stages[0], open_next=lambda: self._open(1, 2, STAGE_LABEL)),
            fake_server(self.stages[1], open_reply=lambda: self._open(2, 0, REPLY_LABEL)),
        ]
        runner = ModelRunner(self.pipeline, max_queue=8, is_end=self.entry.is_end_of_generation)
        self.model = LocalModel(self.entry, runner)
        self.nodes[0]._on_stream = self.pipeline.handle_reply
        self.nodes[1]._on_stream = self.servers[0].handle
        self.nodes[2]._on_stream = self.servers[1].handle

    def _open(self, a: int, b: int, label: str):
        return self.nodes[a].open_stream(self.ids[b], label)

    async def start(self, nursery: trio.Nursery) -> None:
        for node in self.nodes:
            await nursery.start(node.run)
        for server in self.servers:
            await nursery.start(server.run)
        await self.connect()
        await nursery.start(self.model.run)

    async def connect(self, replace: bool = False) -> list:
        """Dial around the ring; the connections now in force (with `replace`, new ones:
        those they replace drain)."""
        for a, b in ((0, 1), (1, 2), (2, 0)):
            address = self.nodes[b].listen_addresses[0]
            await self.nodes[a].dial(address, peer_id=self.ids[b], replace=replace)
        return [self.nodes[a].connection(self.ids[b]) for a, b in ((0, 1), (1, 2), (2, 0))]


async def test_a_request_moves_with_its_streams_when_every_connection_is_replaced(nursery):
    whole = LocalModel.whole(FakeEngine(), max_queue=2)
    await nursery.start(whole.run)
    expected, _ = await complete(whole, "alpha", TOKENS)
    ring = Ring(delay=0.004)
    await ring.start(nursery)
    calm, _ = await complete(ring.model, "beta", 8)  # the chain is up
    old = [ring.nodes[a].connection(ring.ids[b]) for a, b in ((0, 1), (1, 2), (2, 0))]
    closed_at: dict[int, float] = {}

    async def watch(i, conn):
        await conn.wait_closed()
        closed_at[i] = trio.current_time()

    got = {}

    async def request():
        got["text"], got["finish"] = await complete(ring.model, "alpha", TOKENS)
        got["at"] = trio.current_time()

    with structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as n:
            n.start_soon(request)
            while ring.pipeline.chain.made < 30:  # well into the request
                await trio.sleep(0.005)
            new = await ring.connect(replace=True)
            assert all(c is not o for c, o in zip(new, old, strict=True))
            for i, conn in enumerate(old):
                n.start_soon(watch, i, conn)
    assert got["text"] == expected
    assert got["finish"].completion_tokens == TOKENS
    assert ring.pipeline.chain.generation == 0  # never broken, nothing replayed
    moved = [e for e in logs if e["event"] == "stage.stream_moved"]
    assert sorted(e["label"] for e in moved) == sorted([STAGE_LABEL, STAGE_LABEL, REPLY_LABEL])
    assert not [e for e in logs if e["event"] in ("pipeline.broken", "conn.drain_expired")]
    # Every old connection closed as soon as its stream had moved, before the request ended.
    assert len(closed_at) == 3 and max(closed_at.values()) < got["at"]
    assert calm


async def test_a_stream_whose_peer_has_no_other_connection_stays_where_it_is(nursery):
    # The peer is leaving (GOAWAY without a replacement): the request finishes on the old
    # connection during its drain, as it always did.
    ring = Ring(delay=0.004)
    await ring.start(nursery)
    await complete(ring.model, "beta", 8)
    conn = ring.nodes[0].connection(ring.ids[1])
    got = {}

    async def request():
        got["text"], got["finish"] = await complete(ring.model, "alpha", 60)

    with structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as n:
            n.start_soon(request)
            while ring.pipeline.chain.made < 10:
                await trio.sleep(0.005)
            nursery.start_soon(partial(conn.drain_and_close, grace=20))
    assert got["finish"].completion_tokens == 60
    assert ring.pipeline.chain.generation == 0
    assert not [e for e in logs if e["event"] == "stage.stream_moved"]
    # It finished on the draining connection, where the stream down still is.
    assert conn.draining and ring.pipeline.chain._outbox.stream.connection is conn


async def _feed(send, *msgs):
    await send.send_all(b"".join(sm.encode(m) for m in msgs))


class Peered:
    """An in-memory stream that says which peer it comes from."""

    def __init__(self, stream, peer_id: str) -> None:
        self._stream, self.peer_id = stream, peer_id
        self.reset_why: str | None = None

    async def receive_some(self, max_bytes=None):
        return await self._stream.receive_some(max_bytes)

    def reset(self, why: str) -> None:
        self.reset_why = why

    async def aclose(self) -> None:
        await self._stream.aclose()


def _pair(peer: str):
    send, recv = trio.testing.memory_stream_pair()
    return send, Peered(recv, peer)


async def test_a_reader_follows_a_move_in_order_and_only_from_the_same_peer(nursery):
    handover = Handover(wait=1.0)
    send_old, old = _pair("p")
    send_new, new = _pair("p")
    send_other, other = _pair("q")
    closes = [sm.Close(i) for i in range(4)]
    # The continuation (and a forged one from another peer) arrive before the move.
    await _feed(send_other, sm.Continue(7), sm.Close(3))
    await _feed(send_new, sm.Continue(7), closes[2], closes[3])
    for stream in (other, new):
        dec = upstream_decoder()
        first = dec.feed(await stream.receive_some())
        nursery.start_soon(handover.park, stream, first[0].move, dec, first[1:])
    await trio.testing.wait_all_tasks_blocked()
    reader = MovingReader(old, upstream_decoder(), handover)
    await _feed(send_old, closes[0], closes[1], sm.Moved(7))
    got = []
    while len(got) < 4:
        got += await reader.receive()
    assert got == closes
    assert reader.moves == 1 and reader.stream is new
    reader.close()
    with trio.fail_after(2):  # nothing took the other peer's: reset once the wait is over
        while other.reset_why is None:
            await trio.sleep(0.05)


@pytest.mark.parametrize(
    "msgs, error",
    [
        ((sm.Close(0), sm.Continue(1)), "only first"),
        ((sm.Moved(1), sm.Close(0)), "went on after"),
        ((sm.Moved(5),), "nothing continued it"),
    ],
)
async def test_a_move_out_of_place_is_a_protocol_error(msgs, error):
    send, stream = _pair("p")
    reader = MovingReader(stream, upstream_decoder(), Handover(wait=0.2))
    await _feed(send, *msgs)
    with pytest.raises(sm.StageProtocolError, match=error):
        for _ in range(3):
            await reader.receive()
