"""The mesh as `meshagent peers` shows it: gossip records joined with overlay links."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from meshagent.gossip.peer_record import PeerRecord
from meshagent.gossip.state import PeerView
from meshagent.net.coordinates import Coordinate, estimate_ms
from meshagent.net.manager import PeerLink


def peer_rows(
    self_id: str, views: Mapping[str, PeerView], links: Iterable[PeerLink]
) -> list[dict[str, Any]]:
    """One row per peer known to gossip (ourselves first, dead ones included) or connected
    without a record yet; sorted by name then id."""
    by_peer = {link.peer_id: link for link in links}
    own = views.get(self_id)
    mine = own.record.coord if own is not None and own.record is not None else ()
    rows = []
    for pid in sorted(set(views) | set(by_peer)):
        view, link = views.get(pid), by_peer.get(pid)
        rec = view.record if view is not None else None
        rtt = link.rtt.smoothed if link is not None else None
        rows.append(
            {
                "peer_id": pid,
                "self": pid == self_id,
                "name": rec.name if rec else "",
                "state": view.state.value if view else "connecting",
                "path": "local" if pid == self_id else (link.path if link else None),
                "address": _address(link, rec),
                "rtt_ms": None if rtt is None else round(rtt * 1000, 3),
                # not connected: what both network coordinates predict (`net/coordinates.py`)
                "rtt_est_ms": _estimate(mine, rec.coord if rec else ())
                if rtt is None and pid != self_id
                else None,
                "rtts_ms": dict(rec.rtts_ms) if rec else {},  # its RTTs to others (gossip)
                "silent_s": None if view is None else round(view.silent_s, 1),
                "agent_version": rec.agent_version if rec else None,
                "addresses": list(rec.addresses) if rec else [],
                "relays": list(rec.relays) if rec else [],
                "nat": rec.nat if rec else "",
                "mem_weights_bytes": rec.mem_weights_bytes if rec else None,
                "mem_kv_bytes": rec.mem_kv_bytes if rec else None,
                "compute_speed": rec.compute_speed if rec else None,
                "compute_unit": rec.compute_unit if rec else None,
                "mem_spare_bytes": rec.mem_spare_bytes if rec else None,
                "devices": [d.__dict__ for d in rec.devices] if rec else [],
                # its draft model's GFLOP per token, and the smallest model it drafts for
                "draft_gflops": list(rec.draft_gflops) if rec else None,
                "models": [m.id for m in rec.models] if rec else [],
                "stages": [
                    {
                        "model": a.source_name,
                        "kind": a.kind,
                        "layers": [a.start, a.end],
                        "key": a.key,
                    }
                    for a in rec.artifacts
                ]
                if rec
                else [],
                "serving": [
                    {"model": s.model, "layers": [s.start, s.end], "total_layers": s.total_layers}
                    for s in rec.serving
                ]
                if rec
                else [],
            }
        )
    rows.sort(key=lambda r: (not r["self"], r["name"], r["peer_id"]))
    return rows


def _address(link: PeerLink | None, rec: PeerRecord | None) -> str | None:
    """Where the peer is: the address we dialed; for a connection it dialed, its listen
    address on the same host (the connection's remote end is just an ephemeral port)."""
    if link is None:
        return rec.addresses[0] if rec and rec.addresses else None
    if link.initiator or link.path != "direct" or rec is None:
        return link.remote
    host = link.remote.rpartition(":")[0]
    same_host = [a for a in rec.addresses if a.rpartition(":")[0] == host]
    return same_host[0] if same_host else link.remote


def _estimate(mine: tuple[float, ...], theirs: tuple[float, ...]) -> float | None:
    """The RTT in ms two gossiped coordinates predict, or None where either is missing."""
    a, b = Coordinate.from_wire(list(mine)), Coordinate.from_wire(list(theirs))
    return None if a is None or b is None else round(estimate_ms(a, b), 1)
