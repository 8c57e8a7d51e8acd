"""Three agents' split hosts, given one plan, serve the model together over loopback TCP."""

from __future__ import annotations

import trio
import trio.testing

from meshagent.engine.llama import LlamaEngine
from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret
from meshagent.models.layout import inspect_model
from meshagent.net.errors import StreamResetError
from meshagent.net.manager import ConnectionManager
from meshagent.net.tcp import TcpTransport
from meshagent.placement.planner import Plan, StageAssignment
from meshagent.serving import stage_messages as sm
from meshagent.serving.model_files import ModelFiles
from meshagent.serving.pipeline import REPLY_LABEL, STAGE_LABEL
from meshagent.serving.sampling import SamplingParams
from meshagent.serving.settings import ServingSettings
from meshagent.serving.split_host import PartBudgets, SplitHost
from meshagent.wire.handshake import LocalPeer
from tests.serving.conftest import PROMPTS, text_of

MESH = MeshSecret.generate()


async def start_hosts(nursery, model_path, store):
    """Three nodes on loopback, each a split host of one plan (uneven layers on purpose:
    the plan, not a fixed split, decides), dialled in a ring."""
    layout = inspect_model(model_path)
    probe = LlamaEngine(model_path, slots=1, slot_ctx=64)
    info = probe.info
    probe.close()
    nodes = [
        ConnectionManager(
            LocalPeer.create(NodeIdentity.generate(), MESH), TcpTransport(), listen=["127.0.0.1:0"]
        )
        for _ in range(3)
    ]
    plan = Plan(
        info.id,
        1024,
        stages=(
            StageAssignment(nodes[0].peer_id, 0, 12),
            StageAssignment(nodes[1].peer_id, 12, 19),
            StageAssignment(nodes[2].peer_id, 19, 30),
        ),
    )
    hosts = []
    for node in nodes:
        host = SplitHost(
            peer_id=node.peer_id,
            files=ModelFiles(model_path, layout, info, store),
            open_stream=node.open_stream,
            settings=ServingSettings(slots=4, slot_ctx=1024, threads=1, flash_attn=False),
            budgets=PartBudgets(wire_dtype="f32", kept_budget=1 << 30),
        )

        async def route(stream, host=host):
            if stream.label == STAGE_LABEL:
                await host.handle_stage(stream)
            elif stream.label == REPLY_LABEL:
                await host.handle_reply(stream)

        node._on_stream = route
        await nursery.start(node.run)
        await host.load(plan)
        hosts.append(host)
    for a, b in ((0, 1), (1, 2), (2, 0)):
        await nodes[a].dial(nodes[b].listen_addresses[0], peer_id=nodes[b].peer_id)
    return nodes, hosts


async def test_split_hosts_follow_a_plan(model_path, store, reference, nursery):
    _, hosts = await start_hosts(nursery, model_path, store)
    model = hosts[0].model
    assert model is not None and hosts[1].model is None
    try:
        async with trio.open_nursery() as serving:
            await serving.start(model.run)
            assert [await text_of(model, p) for p in PROMPTS] == reference
            serving.cancel_scope.cancel()  # the runner stops before its engine is freed
    finally:
        # A stage's worker may still be clearing the sequences the stopped runner released:
        # `aclose` ends its stream before freeing the engine (`close` alone crashed here).
        for h in hosts:
            await h.aclose()


async def test_a_member_outside_the_plan_cannot_open_a_splits_streams(
    model_path, store, reference, nursery
):
    # A member of the mesh that is not the previous stage opens stage/1 to each later stage
    # (a new upstream stream would replace the chain's and fail every request in flight),
    # and stage-reply/1 to the entry (its tokens would go into other users' completions).
    # Each stream is reset with the reason; the requests in flight finish with llama.cpp's
    # text.
    nodes, hosts = await start_hosts(nursery, model_path, store)
    model = hosts[0].model
    member = ConnectionManager(LocalPeer.create(NodeIdentity.generate(), MESH), TcpTransport())
    await nursery.start(member.run)
    for node in nodes:
        await member.dial(node.listen_addresses[0], peer_id=node.peer_id)
    forged = {
        STAGE_LABEL: sm.encode(sm.Open(0, SamplingParams(temperature=0.0)))
        + sm.encode(sm.Close(0)),
        REPLY_LABEL: sm.encode(sm.Token(0, 42)),
    }
    refusals = []

    async def hostile(peer, label):
        stream = await member.open_stream(peer, label)
        try:
            await stream.send_all(forged[label])
            await stream.receive_some()
        except StreamResetError as e:
            refusals.append(e.reason)

    try:
        async with trio.open_nursery() as serving:
            await serving.start(model.run)
            got = {}

            async def one(i):
                got[i] = await text_of(model, PROMPTS[i])

            async with trio.open_nursery() as n:
                for i in range(len(PROMPTS)):
                    n.start_soon(one, i)
                while not model.runner.busy():
                    await trio.sleep(0.01)
                for peer, label in (
                    (nodes[1].peer_id, STAGE_LABEL),
                    (nodes[2].peer_id, STAGE_LABEL),
                    (nodes[0].peer_id, REPLY_LABEL),
                ):
                    n.start_soon(hostile, peer, label)
            assert [got[i] for i in range(len(PROMPTS))] == reference
            serving.cancel_scope.cancel()
    finally:
        for h in hosts:
            await h.aclose()
    assert sorted(refusals) == sorted(
        [
            f"stage/1 streams come from the previous stage of the split's plan "
            f"({nodes[0].peer_id}), not from {member.peer_id}",
            f"stage/1 streams come from the previous stage of the split's plan "
            f"({nodes[1].peer_id}), not from {member.peer_id}",
            f"stage-reply/1 streams come from the last stage of the split's plan "
            f"({nodes[2].peer_id}), not from {member.peer_id}",
        ]
    )


# ----- who may open a split's streams -----


class FakeStream:
    """What a split host reads of an inbound stream: who opened it, for what; a reset."""

    def __init__(self, peer_id: str, label: str) -> None:
        self.peer_id, self.label = peer_id, label
        self.reset_reason: str | None = None

    def reset(self, reason: str) -> None:
        self.reset_reason = reason


class Served:
    """Stands for the stage server or the entry's pipeline: records the streams it got."""

    def __init__(self) -> None:
        self.streams: list[FakeStream] = []
        self.hold = trio.Event()

    async def handle(self, stream: FakeStream) -> None:
        self.streams.append(stream)

    async def handle_reply(self, stream: FakeStream) -> None:
        self.streams.append(stream)
        await self.hold.wait()


def chain(*peers: str) -> Plan:
    cuts = [0, 10, 20, 30]
    return Plan(
        "m",
        1024,
        stages=tuple(StageAssignment(p, cuts[i], cuts[i + 1]) for i, p in enumerate(peers)),
    )


def host_in(plan: Plan, peer: str) -> SplitHost:
    """A split host of `peer`'s part of `plan`, as `load` leaves it, without the engine."""
    host = SplitHost(
        peer_id=peer,
        files=None,  # type: ignore[arg-type]
        open_stream=None,  # type: ignore[arg-type]
        settings=ServingSettings(),
        budgets=PartBudgets(),
    )
    host.plan = plan
    host.part = next(s for s in plan.stages if s.peer_id == peer)
    host._wire(plan)
    return host


async def test_stage_streams_come_from_the_previous_stage_of_the_plan_in_force():
    host = host_in(chain("a", "b", "c"), "b")
    host.server = served = Served()  # type: ignore[assignment]
    hostile = FakeStream("m", STAGE_LABEL)
    await host.handle_stage(hostile)
    assert "stage/1 streams come from the previous stage of the split's plan (a)" in (
        hostile.reset_reason
    )
    from_next = FakeStream("c", STAGE_LABEL)
    await host.handle_stage(from_next)
    assert from_next.reset_reason is not None
    legit = FakeStream("a", STAGE_LABEL)
    await host.handle_stage(legit)
    assert served.streams == [legit] and legit.reset_reason is None
    # The plan is repaired around a lost entry: the new one's streams are the ones taken.
    host.rewire(chain("d", "b", "c"))
    old = FakeStream("a", STAGE_LABEL)
    await host.handle_stage(old)
    assert old.reset_reason is not None
    await host.handle_stage(new := FakeStream("d", STAGE_LABEL))
    assert served.streams == [legit, new]


async def test_replies_come_from_the_last_stage_and_a_few_at_a_time(nursery):
    host = host_in(chain("a", "b", "c"), "a")
    host.model = object()  # type: ignore[assignment]
    host.pipeline = served = Served()  # type: ignore[assignment]
    for peer in ("b", "m"):
        stream = FakeStream(peer, REPLY_LABEL)
        await host.handle_reply(stream)
        assert "stage-reply/1 streams come from the last stage of the split's plan (c)" in (
            stream.reset_reason
        )
    replies = [FakeStream("c", REPLY_LABEL) for _ in range(4)]
    for stream in replies:
        nursery.start_soon(host.handle_reply, stream)
        await trio.testing.wait_all_tasks_blocked()
    # Each new one from the last stage ends the oldest past two: they stay a handful.
    assert served.streams == replies
    assert [s.reset_reason is not None for s in replies] == [True, True, False, False]
    served.hold.set()
