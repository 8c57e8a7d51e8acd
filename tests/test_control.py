"""The control documents read an agent through `AgentParts`, which `Services` has in full."""

from __future__ import annotations

import ast
import inspect
from types import SimpleNamespace

from meshagent import control, services
from meshagent.identity.mesh import MeshSecret, mesh_fingerprint


def _parts_services_has() -> set[str]:
    """What `Services` sets on itself in `__init__`, and its properties."""
    tree = ast.parse(inspect.getsource(services.Services))
    names = {
        target.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
    }
    return names | {n for n, v in vars(services.Services).items() if isinstance(v, property)}


def test_services_has_every_part_the_documents_read():
    wanted = set(control.AgentParts.__annotations__)
    wanted |= {n for n, v in vars(control.AgentParts).items() if isinstance(v, property)}
    assert "alone" in wanted and "access" in wanted
    assert wanted <= _parts_services_has(), wanted - _parts_services_has()


def test_peers_over_parts_of_an_agent():
    mesh = MeshSecret(b"\x07" * 32)
    agent = SimpleNamespace(
        identity=SimpleNamespace(peer_id="self-id"),
        mesh=mesh,
        alone="no peer answers at 10.0.0.2:9339",
        gossip=SimpleNamespace(snapshot=lambda include_dead: {}),
        overlay=SimpleNamespace(links=lambda: []),
        relays=(),
        dialer=SimpleNamespace(candidates=dict),
        models=[
            SimpleNamespace(
                info=SimpleNamespace(id=name),
                placement_summary=lambda: {"routable": False, "error": "alone", "stages": []},
            )
            for name in ("m", "n")
        ],
    )
    assert control.peers(agent) == {
        "self": "self-id",
        "mesh": mesh_fingerprint(mesh),
        "alone": "no peer answers at 10.0.0.2:9339",
        "peers": [],
        "placement": {
            "m": {"routable": False, "error": "alone"},
            "n": {"routable": False, "error": "alone"},
        },
    }
