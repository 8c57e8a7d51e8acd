"""The `meshagent peers` rows: gossip records joined with overlay links."""

from __future__ import annotations

from meshagent.discovery.mesh_view import peer_rows
from meshagent.gossip.failure import PeerState
from meshagent.gossip.peer_record import PeerRecord, Serving
from meshagent.gossip.state import PeerView
from meshagent.net.manager import PeerLink
from meshagent.wire.rtt import RttSnapshot


def view(pid: str, name: str, state=PeerState.ALIVE, addresses=("10.0.0.9:9338",)) -> PeerView:
    rec = PeerRecord(
        pid, b"k" * 32, 1, name=name, addresses=addresses, serving=(Serving("m", "", 0, 4, 8),)
    )
    return PeerView(pid, rec, state, 0.5, 1)


def link(pid: str, remote: str, *, initiator: bool, path: str = "direct") -> PeerLink:
    return PeerLink(pid, "s", path, remote, initiator, RttSnapshot(0.002, 0.0021, 0.002, 3), 0.0)


def test_rows_join_records_and_links():
    views = {
        "me": view("me", "self"),
        "b": view("b", "bee", addresses=("10.0.0.2:9338", "192.168.1.2:9338")),
        "c": view("c", "cee", PeerState.DEAD),
        "r": view("r", "arr"),
    }
    links = [
        link("b", "192.168.1.2:50123", initiator=False),  # b dialed us
        link("r", "relay 10.9.9.9:9339", initiator=True, path="relayed"),
        link("x", "10.0.0.7:9338", initiator=True),  # connected, no record yet
    ]
    rows = {r["peer_id"]: r for r in peer_rows("me", views, links)}
    assert next(iter(peer_rows("me", views, links)))["peer_id"] == "me"
    assert rows["me"]["path"] == "local" and rows["me"]["self"]
    assert (
        rows["b"]["address"] == "192.168.1.2:9338"
    )  # its listen address, not the port it dialed from
    assert rows["b"]["rtt_ms"] == 2.1 and rows["b"]["serving"][0]["layers"] == [0, 4]
    assert rows["c"]["state"] == "dead" and rows["c"]["path"] is None
    assert rows["c"]["address"] == "10.0.0.9:9338"
    assert rows["r"]["path"] == "relayed" and rows["r"]["address"] == "relay 10.9.9.9:9339"
    assert rows["x"]["state"] == "connecting" and rows["x"]["name"] == ""
