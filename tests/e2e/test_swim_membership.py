"""Three agent processes with `--membership swim`, each too small for the model, find each
other over real sockets, split the model and serve it; a killed one is dead everywhere
within seconds and the other two carry on without it."""

from __future__ import annotations

import os
import signal
import time

import httpx

from tests.e2e.agents import complete, spawn_mesh, status, wait_for
from tests.e2e.test_split_serving import SMALL


def _peers(agent) -> dict[str, str]:
    """Every member this agent knows, by peer id, with its state."""
    views = httpx.get(f"{agent.url}/control/peers", timeout=10).json()["peers"]
    return {p["peer_id"]: p["state"] for p in views}


def test_agents_on_membership_by_probes_split_serve_and_bury_a_killed_one(spawn_agent):
    agents = spawn_mesh(spawn_agent, *SMALL, "--membership", "swim")
    ids = [status(a)["peer_id"] for a in agents]
    model_id = httpx.get(f"{agents[0].url}/v1/models", timeout=10).json()["data"][0]["id"]

    def split() -> bool:
        return (
            all(status(a)["placement"][model_id]["routable"] for a in agents)
            and len(status(agents[0])["placement"][model_id]["stages"]) == 3
        )

    wait_for(split, timeout=120)
    for a in agents:
        g = status(a)["gossip"]
        assert g["protocol"] == "swim" and g["states"] == {"alive": 3}
        assert g["rejected"] == 0 and g["bytes_sent"] > 0
        assert set(_peers(a)) >= set(ids)
    text = complete(agents[1], model_id, "The capital of France is", stream=True)
    assert text.strip()

    victim = agents[2]
    os.kill(victim.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    rest = agents[:2]
    wait_for(lambda: all(_peers(a).get(ids[2]) == "dead" for a in rest), timeout=30)
    assert time.monotonic() - killed < 15
    for a in rest:  # nobody else was taken for dead meanwhile
        assert [p for p, s in _peers(a).items() if s == "dead"] == [ids[2]]
