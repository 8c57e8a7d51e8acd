"""Three agents' split hosts, given one plan, serve the model together over loopback TCP."""

from __future__ import annotations

import trio

from meshagent.engine.llama import LlamaEngine
from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret
from meshagent.models.layout import inspect_model
from meshagent.net.manager import ConnectionManager
from meshagent.net.tcp import TcpTransport
from meshagent.placement.planner import Plan, StageAssignment
from meshagent.serving.pipeline import REPLY_LABEL, STAGE_LABEL
from meshagent.serving.split_host import SplitHost, SplitSettings
from meshagent.wire.handshake import LocalPeer
from tests.serving.conftest import PROMPTS, text_of

MESH = MeshSecret.generate()


async def test_split_hosts_follow_a_plan(model_path, store, reference, nursery):
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
    # Uneven layers on purpose: the plan, not a fixed split, decides.
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
            model_path=model_path,
            layout=layout,
            info=info,
            store=store,
            open_stream=node.open_stream,
            settings=SplitSettings(
                slots=4, slot_ctx=1024, threads=1, wire_dtype="f32", flash_attn=False
            ),
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
