"""The `meshagent peers` rows: gossip records joined with overlay links."""

from __future__ import annotations

from meshagent.cli.peers import table
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


def test_a_peer_not_connected_shows_the_rtt_its_coordinates_predict():
    def placed(pid: str, coord: tuple[float, ...]) -> PeerView:
        rec = PeerRecord(pid, b"k" * 32, 1, name=pid, coord=coord)
        return PeerView(pid, rec, PeerState.ALIVE, 0.5, 1)

    views = {
        "me": placed("me", (0.0, 0.0, 1.0, 0.2)),
        "far": placed("far", (30.0, 40.0, 2.0, 0.2)),  # 50 ms away in the plane, plus heights
        "near": placed("near", (3.0, 4.0, 1.0, 0.2)),
        "lost": placed("lost", ()),  # no coordinate yet
    }
    rows = {
        r["peer_id"]: r
        for r in peer_rows("me", views, [link("near", "10.0.0.3:9338", initiator=True)])
    }
    assert rows["far"]["rtt_ms"] is None and rows["far"]["rtt_est_ms"] == 53.0
    assert rows["near"]["rtt_ms"] == 2.1 and rows["near"]["rtt_est_ms"] is None  # measured
    assert rows["lost"]["rtt_est_ms"] is None and rows["me"]["rtt_est_ms"] is None
    assert "~53ms" in table(list(rows.values())) and "2.1ms" in table(list(rows.values()))
