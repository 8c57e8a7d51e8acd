"""The control API's documents about one agent: its status (`GET /control/status`, shown by
`meshagent status`), the peers it knows (`GET /control/peers`, `meshagent peers`), and path
probes to a connected peer (`POST /control/probe`)."""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from meshagent import __version__
from meshagent.discovery import probe as path_probe
from meshagent.discovery.mesh_view import peer_rows
from meshagent.discovery.nat import Reachability
from meshagent.identity.mesh import mesh_fingerprint
from meshagent.models.ranged import PartialModel, is_partial
from meshagent.net.manager import ConnectionManager

if TYPE_CHECKING:
    from collections.abc import Callable

    from meshagent.api.access import Access
    from meshagent.api.inflight import InFlight
    from meshagent.discovery.dialer import PeerDialer
    from meshagent.discovery.lan import LanDiscovery
    from meshagent.gossip.membership import Membership
    from meshagent.identity.keys import NodeIdentity
    from meshagent.identity.mesh import MeshSecret
    from meshagent.models.artifacts import ArtifactStore
    from meshagent.relay.client import RelayClient
    from meshagent.serving.assigning import Assigning
    from meshagent.serving.local_model import LocalModel
    from meshagent.serving.model_host import ModelHost


class AgentParts(Protocol):
    """What the documents read of one running agent (`services.Services` has it all)."""

    identity: NodeIdentity
    mesh: MeshSecret
    name: str
    api_url: str
    access: Access  # who may use the HTTP API
    started_at: float  # time.time() at start
    inflight: InFlight
    overlay: ConnectionManager
    relays: tuple[RelayClient, ...]
    lan: LanDiscovery
    gossip: Membership
    models: ModelHost
    assigning: Assigning
    store: ArtifactStore
    dialer: PeerDialer

    @property
    def alone(self) -> str | None:
        """Why the agent has no peer though it was told where its mesh is, while so."""

    def advertised(self) -> list[str]:
        """The overlay addresses this agent's record carries."""

    def reachability(self) -> Reachability:
        """This agent's NAT and public address as its relays see them."""


def status(services: AgentParts) -> dict[str, Any]:
    s = services
    return {
        "peer_id": s.identity.peer_id,
        "name": s.name,
        "version": __version__,
        "pid": os.getpid(),
        "mesh": mesh_fingerprint(s.mesh),
        "api": s.api_url,
        # Who may use the HTTP API: how many keys it asks for (0: none), and whether Host
        # must name loopback.
        "api_access": {
            "keys": len(s.access.keys),
            "loopback_host_only": bool(s.access.hosts),
        },
        "listen": [str(a) for a in s.overlay.listen_addresses],
        "uptime_s": round(time.time() - s.started_at, 1),
        "state": "draining" if s.inflight.draining else "serving",
        "alone": s.alone,
        "in_flight": len(s.inflight),
        "models": _models(s),
        "placement": {m.info.id: m.placement_summary() for m in s.models},
        # every catalogued model as the mesh assigns it (placed where, or why not; demand)
        "assignment": s.assigning.summary(),
        "artifacts": [m.to_dict() for m in s.store.all()],
        "download": _download(s),
        "peers": _links(s.overlay),
        "overlay_traffic": s.overlay.traffic(),
        "advertised": s.advertised(),
        "reachability": s.reachability().to_dict(),
        "relays": [
            {
                "address": r.name,
                "registered": r.registered,
                "members": sorted(r.members),
                "error": r.last_error,
                "observed": str(r.observed) if r.observed else None,
            }
            for r in s.relays
        ],
        "mdns": _mdns(s),
        "gossip": _gossip(s),
    }


def _download(s: AgentParts) -> dict[str, Any] | None:
    """A model held in part (`models/ranged.py`): what came from the hub and from peers,
    and the artifacts being downloaded now (the first such model's)."""
    for model in s.models:
        path = Path(model.files.path)
        if is_partial(path):
            return {**PartialModel(path).status(), "fetching": model.source.downloads()}
    return None


def _models(s: AgentParts) -> list[dict[str, Any]]:
    out = []
    for mesh_model in s.models:
        model = mesh_model.local
        if model is None:
            continue
        out.append(
            {
                "id": model.info.id,
                "path": model.info.path,
                "layers": list(mesh_model.layers()),
                "slots": asdict(model.runner.stats()),
                "speculation": _speculation(model),
                "prefix_cache": _prefix_cache(model),
            }
        )
    return out


def _prefix_cache(model: LocalModel) -> dict[str, Any]:
    """What this model may keep of ended requests' KV, and whether prompts reuse it."""
    executor = model.runner.executor
    return {
        "budget_bytes": executor.prefix_budget,
        "on": model.runner.scheduler.prefix is not None,
        "reason": executor.prefix_reason,
    }


def _speculation(model: LocalModel) -> dict[str, Any]:
    """The default mode, whether this engine's draft windows are exact (checked at load), and
    what its decode steps cost by their tokens (what `auto` weighs drafts against)."""
    executor = model.runner.executor
    return {
        "default": model.speculation,
        "exact_windows": executor.exact_windows,
        "reason": executor.windows_reason,
        "window_cost": model.runner.scheduler.window_cost.summary(),
        "draft_model": _draft_model(model),
    }


def _draft_model(model: LocalModel) -> dict[str, Any] | None:
    """The model's draft model, if it has one: its name, what one of its forward passes
    takes (a moving mean), and that in the model's one-token steps (what "auto" charges each
    drafted token); the text it read ahead of its proposals (a split's entry, while windows
    travel) and when asked for one (which the proposal waited on), tokens and time; and how
    often its drafted tokens were right given those before them were, over the sequences
    ("auto": its windows and the proposals it did not send, recent ones weighing most)."""
    policy = model.runner.scheduler.drafting
    if policy.model is None:
        return None
    forward = policy.model_forward
    right = policy.model_right
    return {
        "name": policy.model.name,
        "forward_ms": None if forward is None else round(forward * 1000, 3),
        "cost_in_steps": round(policy.model_extra(), 4),
        "right": {
            "p": round(right.value, 4) if right.trials > 0 else None,
            "judged": round(right.trials, 1),
        },
        "read_ahead": policy.model.read_ahead.summary(),
        "read_when_asked": policy.model.read_when_asked.summary(),
    }


def _links(overlay: ConnectionManager) -> list[dict[str, Any]]:
    out = []
    for link in overlay.links():
        rtt = link.rtt.smoothed if link.rtt is not None else None
        out.append(
            {
                "peer_id": link.peer_id,
                "path": link.path,
                "address": str(link.remote),
                "rtt_ms": None if rtt is None else round(rtt * 1000, 3),
                "initiator": link.initiator,
                "bytes_sent": link.bytes_sent,
                "bytes_received": link.bytes_received,
            }
        )
    return out


def _mdns(s: AgentParts) -> dict[str, Any]:
    mdns = s.lan.mdns
    return {
        "enabled": mdns is not None,
        "note": s.lan.note,
        "advertised": mdns.registered if mdns else False,
        "interfaces": mdns.interfaces if mdns else [],
        "seen": [x.to_dict() for x in mdns.sightings.values()] if mdns else [],
    }


def _gossip(s: AgentParts) -> dict[str, Any]:
    return s.gossip.summary()


def peers(services: AgentParts) -> dict[str, Any]:
    """Every peer gossip knows, with its link."""
    s = services
    return {
        "self": s.identity.peer_id,
        "mesh": mesh_fingerprint(s.mesh),
        "alone": s.alone,
        "peers": _why_relayed(
            s,
            peer_rows(s.identity.peer_id, s.gossip.snapshot(include_dead=True), s.overlay.links()),
        ),
        # whether the mesh serves each model, and why not (the words `status` uses)
        "placement": {
            m.info.id: {"routable": summary["routable"], "error": summary["error"]}
            for m, summary in ((m, m.placement_summary()) for m in s.models)
        },
    }


def _why_relayed(s: AgentParts, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each relayed peer's row says why it is not direct (`PeerDialer.why_relayed`)."""
    for row in rows:
        relayed = row["path"] == "relayed"
        row["why_relayed"] = s.dialer.why_relayed(row["peer_id"]) if relayed else None
    return rows


async def probe(
    overlay: ConnectionManager, body: dict[str, Any], names: Callable[[], dict[str, str]]
) -> dict[str, Any]:
    """Push bytes to the connected peer `body["peer"]` names (its name, as its record gives
    it, or the start of its id) and verify them: at most `probe.MAX_BYTES`, paced over at
    most `probe.MAX_SECONDS`, within a deadline."""
    want, total, seconds = body.get("peer", ""), body.get("bytes", 1 << 20), body.get("seconds", 0)
    if not isinstance(want, str):
        raise path_probe.ProbeError("a probe's 'peer' must be a peer's name or the start of its id")
    if not isinstance(total, int) or isinstance(total, bool):
        raise path_probe.ProbeError(f"a probe's 'bytes' must be an integer, not {total!r}")
    if not isinstance(seconds, int | float) or isinstance(seconds, bool):
        raise path_probe.ProbeError(f"a probe's 'seconds' must be a number, not {seconds!r}")
    path_probe.check(total, float(seconds))
    connected = [link.peer_id for link in overlay.links()]
    known = names()
    matches = [p for p in connected if want and known.get(p, "").lower() == want.lower()]
    if not matches:
        matches = [p for p in connected if want and p.startswith(want)]
    if len(matches) != 1:
        raise path_probe.ProbeError(
            f"{want[:80]!r} names {len(matches)} connected peers: give a peer's name, or more "
            "of its id (`meshagent peers` lists both)"
        )
    result = await path_probe.probe(overlay, matches[0], total=total, seconds=float(seconds))
    return {**result, "name": known.get(matches[0], "")}
