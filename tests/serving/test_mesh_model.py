"""The agent's model in the mesh: the directory it gives the API as placement places the model,
the stages a replay names, the drafts a split allows, and the room a part leaves for prefixes."""

from __future__ import annotations

from types import SimpleNamespace

import trio

from meshagent.engine.llama import read_model_info
from meshagent.gossip.failure import PeerState
from meshagent.models.capability import CapabilityStore
from meshagent.models.layout import inspect_model
from meshagent.placement.planner import Plan, StageAssignment
from meshagent.serving.capabilities import Capabilities
from meshagent.serving.directory import GENERATE_LABEL, RemoteModel
from meshagent.serving.mesh_model import MeshModel
from meshagent.serving.model_files import ModelFiles
from meshagent.serving.obtain import cuts_here, spare_cuts
from meshagent.serving.settings import ServingSettings
from meshagent.serving.wire_choice import judge_windows
from tests.placement.test_service import GB, FakeGossip, Record, View, World


def _mesh_model(pid, world, model_path, store, settings):
    layout, info = inspect_model(model_path), read_model_info(model_path)
    return MeshModel(
        peer_id=pid,
        files=ModelFiles(model_path, layout, info, store),
        overlay=FakeOverlay(),
        gossip=FakeGossip(world, pid),
        capabilities=Capabilities(
            CapabilityStore(store.capabilities_path), FakeGossip(world, pid).snapshot
        ),
        settings=settings,
    )


class FakeOverlay:
    async def open_stream(self, peer_id: str, label: str, **window):
        return peer_id, label


async def test_the_directory_lists_what_the_plan_in_force_serves_where(model_path, store, nursery):
    world = World()
    world.views["a"] = View(Record(8 * GB))
    world.views["b"] = View(Record(0))  # offers no memory: it only routes
    layout, info = inspect_model(model_path), read_model_info(model_path)
    settings = ServingSettings(slots=1, slot_ctx=256, threads=1, max_queue=2)
    ma, mb = (_mesh_model(pid, world, model_path, store, settings) for pid in ("a", "b"))
    await nursery.start(ma.run)
    await nursery.start(mb.run)
    a, b = ma.directory, mb.directory
    with trio.fail_after(60):
        while not (a.local_models() and b.remote_models()):
            await trio.sleep(0.1)

    # a serves the model whole, and its receipt says so.
    [served] = a.local_models()
    assert served.info.id == info.id and served is ma.local
    assert a.receipt(served) == [(b"x-meshagent-stages", f"a:0-{layout.n_layers}".encode())]
    assert a.remote_models() == []
    assert ma.placement_summary()["loading"] == []  # every peer of the plan has its part
    # b serves nothing itself and knows where the model runs.
    assert b.local_models() == [] and b.receipt(served) == []
    assert b.remote_models() == [RemoteModel(info.id, "a", "whole", (), layout.n_layers, 256)]
    assert await b.open_stream("a") == ("a", GENERATE_LABEL)

    # A part withdrawn is no longer listed, nor its receipt given.
    await ma.aclose()
    assert a.local_models() == [] and a.receipt(served) == []
    await mb.aclose()


async def test_a_replay_names_the_stages_whose_peers_were_declared_dead(model_path, store):
    world = World()
    for pid in "abcd":
        world.views[pid] = View(Record(GB))
    settings = ServingSettings(slots=1, slot_ctx=256, threads=1, max_queue=2)
    m = _mesh_model("a", world, model_path, store, settings)
    split = [
        StageAssignment("a", 0, 10),
        StageAssignment("b", 10, 20),
        StageAssignment("c", 20, 30),
    ]
    broken = Plan("m", 256, stages=tuple(split))
    m.directory._plan = broken
    assert m.rerouting.lost_stages() == set()
    world.views["b"] = View(Record(GB), state=PeerState.DEAD)
    assert m.rerouting.lost_stages() == {"b:10-20"}
    # The plan was repaired before the request asked: the one it broke on still counts.
    repaired = Plan("m", 256, stages=(split[0], StageAssignment("d", 10, 20), split[2]))
    m.directory._replaced, m.directory._plan = (broken, trio.current_time()), repaired
    del world.views["b"]  # forgotten, as a dead peer leaves the snapshot
    assert m.rerouting.lost_stages() == {"b:10-20"}
    # A peer in both plans is named once, by its stage in the plan served now.
    moved = Plan(
        "m", 256, stages=(split[0], StageAssignment("b", 10, 22), StageAssignment("c", 22, 30))
    )
    m.directory._replaced, m.directory._plan = (broken, trio.current_time()), moved
    assert m.rerouting.lost_stages() == {"b:10-22"}
    # A peer that left a plan alive (the mesh moved its layers) was not lost.
    world.views["b"] = View(Record(GB))
    assert m.rerouting.lost_stages() == set()


def test_a_split_drafts_by_default_only_where_every_stage_computes_windows_exactly(
    model_path, store
):
    # Each agent says in gossip whether its llama.cpp computes a window as it computes
    # one-token steps; the entry's own build is not enough: a stage on another build makes
    # the split's windows inexact, so `auto` does not draft there (and status says why).
    world = World()
    for pid in "abc":
        world.views[pid] = View(Record(GB, name=f"host-{pid}"))
    views = FakeGossip(world, "a").snapshot
    entry = SimpleNamespace(exact_windows=True, windows_reason="a split: judged by this build")
    pipeline = SimpleNamespace(entry=entry, exact_windows=True, windows_reason=entry.windows_reason)
    plan = Plan("m", 256, stages=(StageAssignment("a", 0, 10), StageAssignment("c", 10, 30)))
    judge_windows(pipeline, plan, views(), "a")
    assert pipeline.exact_windows and pipeline.windows_reason == entry.windows_reason
    world.views["c"] = View(Record(GB, name="host-c", windows_inexact="built with LLAMAFILE"))
    judge_windows(pipeline, plan, views(), "a")
    assert not pipeline.exact_windows
    assert pipeline.windows_reason == (
        "a split: the stage on host-c (c) computes windows otherwise: built with LLAMAFILE"
    )
    # A repaired plan without that stage drafts again.
    repaired = Plan("m", 256, stages=(plan.stages[0], StageAssignment("b", 10, 30)))
    judge_windows(pipeline, repaired, views(), "a")
    assert pipeline.exact_windows


def test_a_spare_cuts_every_stage_of_the_split_it_may_join_and_nothing_else():
    stages = (StageAssignment("a", 0, 9), StageAssignment("b", 9, 21), StageAssignment("c", 21, 30))
    split = Plan("m", 256, stages=stages)
    assert spare_cuts(split, "d") == [
        ("entry", 0, 0),
        ("layers", 0, 9),
        ("layers", 9, 21),
        ("layers", 21, 30),
    ]
    assert spare_cuts(split, "b") == []  # in the plan: it has its own part
    assert spare_cuts(Plan("m", 256, replicas=("a",)), "d") == []  # nothing to take over
    # What each keeps on disk through a prune: its part, or as a spare every stage.
    assert cuts_here(split, "a") == [("entry", 0, 0), ("layers", 0, 9)]
    assert cuts_here(split, "c") == [("layers", 21, 30)]
    assert cuts_here(split, "d") == spare_cuts(split, "d")
    assert cuts_here(Plan("m", 256, replicas=("a",)), "a") == []


def test_a_splits_entry_keeps_prefixes_within_every_stages_room(model_path, store):
    # Each later stage holds what the entry tells it to keep, up to what its part leaves free
    # of its offer (beyond that it refuses, and the chain breaks): the entry's budget stays
    # within a share of the least of them, however much it has free itself.
    from meshagent.serving.parts import _STAGE_SHARE

    world = World()
    for pid, gb in (("a", 8), ("b", 1), ("c", 2)):
        world.views[pid] = View(Record(gb * GB))
    settings = ServingSettings(slots=2, slot_ctx=512, threads=1, max_queue=2)
    a, b, c = (_mesh_model(pid, world, model_path, store, settings) for pid in "abc")
    plan = Plan(
        a.info.id,
        1024,
        stages=(
            StageAssignment("a", 0, 10),
            StageAssignment("b", 10, 20),
            StageAssignment("c", 20, 30),
        ),
    )
    room = {pid: m.parts.free_bytes(plan, pid) for pid, m in zip("abc", (a, b, c), strict=True)}
    assert room["b"] < room["c"] < room["a"]
    assert a.parts.prefix_budget(plan) == int(room["b"] * _STAGE_SHARE)
    assert (
        b.parts.free_bytes(plan, "b") == room["b"] == a.parts.free_bytes(plan, "b")
    )  # as b holds it


def test_the_serving_settings_are_the_configs_where_it_names_them():
    from meshagent.config import AgentConfig

    config = AgentConfig(
        ctx_size=1024,
        slots=3,
        max_queue=7,
        threads=2,
        wire_dtype="f16",
        replay_deadline=12.5,
        speculation="off",
        prefix_cache=4096,
    )
    got = ServingSettings.of(config, vram=1 << 30)
    assert (got.slot_ctx, got.slots, got.max_queue, got.threads) == (1024, 3, 7, 2)
    assert (got.wire_dtype, got.replay_deadline, got.speculation) == ("f16", 12.5, "off")
    assert (got.prefix_cache, got.vram) == (4096, 1 << 30)
