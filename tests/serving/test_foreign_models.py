"""The models an agent takes no part in, read from its peers' placement claims."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from meshagent.gossip.failure import PeerState
from meshagent.gossip.peer_record import PeerRecord, Serving
from meshagent.placement.negotiation import Claim
from meshagent.placement.planner import Plan, StageAssignment
from meshagent.placement.service import EXTRAS_KEY
from meshagent.serving.directory import RemoteModel
from meshagent.serving.foreign_models import claimed_models, foreign_models

WHOLE = Plan("chat", 512, replicas=("p1", "p2"))
SPLIT = Plan("coder", 512, stages=(StageAssignment("p2", 0, 10), StageAssignment("p3", 10, 28)))


def _view(pid: str, claims: list[Claim], state=PeerState.ALIVE, serving=()) -> SimpleNamespace:
    record = PeerRecord(pid, b"", 1, serving=serving)
    extras = {EXTRAS_KEY: {c.model_id: c.to_cbor() for c in claims}}
    return SimpleNamespace(state=state, record=replace(record, extras=extras))


def _claim(plan: Plan, ready: bool = True) -> Claim:
    return Claim(plan.model_id, 3, "p1", plan, ready)


def test_a_peers_model_served_whole_or_split_is_listed_with_its_entry_or_replicas():
    views = {
        "p1": _view("p1", [_claim(WHOLE)], serving=(Serving("chat", "", 0, 30, 30),)),
        "p2": _view("p2", [_claim(WHOLE), _claim(SPLIT)]),
        "p3": _view("p3", [_claim(SPLIT)]),
    }
    assert claimed_models(views) == {"chat", "coder"}
    assert foreign_models(views, hosted=set()) == [
        RemoteModel("chat", "p1", "whole", (), 30),
        RemoteModel("chat", "p2", "whole", (), 0),
        RemoteModel("coder", "p2", "split", (("p2", 0, 10), ("p3", 10, 28)), 28),
    ]
    # One this agent takes part in is its own directory's to answer for.
    assert [r.id for r in foreign_models(views, hosted={"chat"})] == ["coder"]


def test_a_split_missing_a_ready_stage_or_a_dead_replica_is_not_listed():
    views = {
        "p1": _view("p1", [_claim(WHOLE)], state=PeerState.DEAD),
        "p2": _view("p2", [_claim(WHOLE, ready=False), _claim(SPLIT)]),
        "p3": _view("p3", [_claim(SPLIT, ready=False)]),
    }
    assert foreign_models(views, hosted=set()) == []
    assert claimed_models(views) == {"chat", "coder"}  # still the mesh's: worth waiting for


def test_claims_that_do_not_decode_are_left_out():
    bad = SimpleNamespace(
        state=PeerState.ALIVE,
        record=replace(PeerRecord("p9", b"", 1), extras={EXTRAS_KEY: {"chat": {0: 99}, 7: 1}}),
    )
    assert foreign_models({"p9": bad}, hosted=set()) == []
    assert claimed_models({"p9": bad}) == {"chat"}
