"""What an agent remembers of its mesh between starts (`discovery/known.py`)."""

from __future__ import annotations

import json

import trio

from meshagent.discovery import known as known_mod
from meshagent.discovery.known import FORGET_AFTER, MAX_PEERS, Known


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_what_is_known_survives_a_restart(tmp_path):
    path, clock = tmp_path / "known.json", Clock()
    k = Known.load(path, "mesh-a", clock=clock)
    assert not k and k.addresses() == []
    k.note_bootstrap(["10.0.0.1:9338", "10.0.0.1:9338"])
    k.note_relays(["relay.example:9339"])
    k.note_peer("p1", ["10.0.0.2:9338"], ["relay.example:9339"])
    clock.now += 5
    k.note_peer("p2", ["10.0.0.3:9338", "10.0.0.2:9338"])
    assert k.save() and not k.save()  # nothing new: no second write
    again = Known.load(path, "mesh-a", clock=clock)
    assert [p.peer_id for p in again.peers] == ["p2", "p1"]  # most recently seen first
    assert again.peers[1].relays == ("relay.example:9339",)
    assert again.bootstrap == ("10.0.0.1:9338",)
    assert again.relays == ("relay.example:9339",)
    assert again.addresses() == ["10.0.0.1:9338", "10.0.0.3:9338", "10.0.0.2:9338"]


def test_a_peer_seen_again_with_nothing_new_is_written_about_once_an_hour(tmp_path):
    clock = Clock()
    k = Known(tmp_path / "known.json", "m", clock=clock)
    k.note_peer("p1", ["10.0.0.2:9338"])
    assert k.save()
    clock.now += 600
    k.note_peer("p1", ["10.0.0.2:9338"])
    assert not k.save()
    k.note_peer("p1", ["10.0.0.9:9338"])  # an address moved: written at once
    assert k.save()
    clock.now += 3601
    k.note_peer("p1", ["10.0.0.9:9338"])
    assert k.save()


def test_another_mesh_or_a_broken_file_is_nothing_known(tmp_path):
    path, clock = tmp_path / "known.json", Clock()
    k = Known(path, "mesh-a", clock=clock)
    k.note_peer("p1", ["10.0.0.2:9338"])
    k.save()
    assert not Known.load(path, "mesh-b")  # --join replaced the mesh
    for broken in (
        "{",
        "[]",
        json.dumps(
            {
                "version": 1,
                "mesh": "mesh-a",
                "peers": [{"peer_id": "p", "seen": 1}],
                "bootstrap": ["no port"],
            }
        ),
        json.dumps({"version": 1, "mesh": "mesh-a", "peers": [{"peer_id": 7, "seen": 1}]}),
        json.dumps({"version": 1, "mesh": "mesh-a", "peers": [{"peer_id": "p"}]}),
    ):
        path.write_text(broken)
        assert not Known.load(path, "mesh-a", clock=clock), broken


def test_old_and_surplus_peers_are_forgotten(tmp_path):
    clock = Clock()
    k = Known(tmp_path / "known.json", "m", clock=clock)
    k.note_peer("old", ["10.0.0.2:9338"])
    clock.now += FORGET_AFTER + 1
    for i in range(MAX_PEERS + 5):
        clock.now += 1
        k.note_peer(f"p{i}", [f"10.0.1.{i}:9338"])
    ids = [p.peer_id for p in k.peers]
    assert len(ids) == MAX_PEERS and "old" not in ids and ids[0] == f"p{MAX_PEERS + 4}"


async def test_keep_writes_the_live_peers_and_once_more_on_stop(tmp_path, autojump_clock):
    path = tmp_path / "known.json"
    k = Known(path, "m")
    alive = [("p1", ("10.0.0.2:9338",), ())]
    async with trio.open_nursery() as n:
        n.start_soon(known_mod.keep, k, lambda: alive, 30.0)
        await trio.sleep(31)
        assert [p["peer_id"] for p in json.loads(path.read_text())["peers"]] == ["p1"]
        alive.append(("p2", ("10.0.0.3:9338",), ()))
        await trio.sleep(1)
        n.cancel_scope.cancel()
    assert {p["peer_id"] for p in json.loads(path.read_text())["peers"]} == {"p1", "p2"}
