"""Gossip benchmark on the simulated network (virtual clock): how fast N agents converge on a
full membership view, what gossip costs per agent per second, how stale heartbeats get, and
how long until a killed agent is dead everywhere.

Each agent is a real ConnectionManager (Noise handshake, encrypted records) + GossipService +
PeerDialer on `meshagent.testing.sim_network` with 10 ms one-way links, bootstrapped by
dialing agent 0; no models, no HTTP. Times are virtual seconds (trio MockClock), so they do not
depend on this machine's load; the wall time of each run is reported too. Prints a table and
writes JSON (default bench/results/gossip.json). Never asserts.

    .venv/bin/python bench/gossip.py [--sizes 3,10,30] [--window 60] [--membership heartbeat]

Membership by probes (`gossip/swim_service.py`, the agent's default) runs in every agent over
the overlay up to `--overlay-max` agents; `--membership heartbeat` runs the heartbeat protocol
instead. Every size also runs
on the message bus of `meshagent/testing/swim_bus.py` (what `bench/swim.py --signed --bounded`
measures: the members signed, every message through the codec, each on a bounded set of
connections as agents are): formation, the steady cost, a join seen
everywhere, a crash dead everywhere and false deaths at 1% loss, at sizes the overlay cannot
reach here (a thousand).

    .venv/bin/python bench/gossip.py --sizes 10,100,300,1000 --membership swim
    .venv/bin/python bench/gossip.py --sizes 10,30,60 --membership swim --no-bus

Membership by probes keeps connections to a bounded set of members (`discovery/keep.py`); the
connections each agent holds at the end of the window are reported.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from pathlib import Path

import result_file
import structlog
import swim
import trio
import trio.testing

from meshagent.gossip.config import GossipConfig
from meshagent.testing.sim_agents import start_sim_agent
from meshagent.testing.sim_network import LinkSpec, SimNetwork


async def run_one(
    n: int, window: float, config: GossipConfig, membership: str, settle: float
) -> dict[str, float | str | None]:
    net = SimNetwork(default=LinkSpec(latency=0.010), seed=n)
    async with trio.open_nursery() as nursery:
        agents = [
            await start_sim_agent(
                nursery, net, f"h{i}", seed=i, gossip_config=config, membership=membership
            )
            for i in range(n)
        ]
        for a in agents[1:]:
            nursery.start_soon(a.overlay.dial, agents[0].overlay.listen_addresses[0])
        t0 = trio.current_time()
        everyone = {a.peer_id for a in agents}
        while not all(a.alive_view() == everyone for a in agents):
            await trio.sleep(0.05)
        converged = trio.current_time() - t0
        await trio.sleep(settle)  # the full mesh of connections, their RTTs in the records

        gossip0 = [a.gossip.bytes_sent for a in agents]
        wire0 = [_sent(a) for a in agents]
        worst_age = 0.0
        end = trio.current_time() + window
        while trio.current_time() < end:
            await trio.sleep(0.25)
            now = trio.current_time()
            for a in agents:
                if membership == "swim":
                    continue  # no heartbeats: probes
                for pid, e in a.gossip.state.entries.items():
                    if pid != a.peer_id:
                        worst_age = max(worst_age, now - e.last_progress)
        connections = [len(a.overlay.connections()) for a in agents]
        gossip = [a.gossip.bytes_sent - g for a, g in zip(agents, gossip0, strict=True)]
        wire = [_sent(a) - w for a, w in zip(agents, wire0, strict=True)]

        victim = agents[n // 2]
        victim.scope.cancel()
        killed = trio.current_time()
        rest = [a for a in agents if a is not victim]
        while any(victim.peer_id in a.alive_view() for a in rest):
            await trio.sleep(0.05)
        detected = trio.current_time() - killed
        nursery.cancel_scope.cancel()
    return {
        "membership": membership,
        "agents": n,
        "converged_s": round(converged, 2),
        "gossip_bytes_per_agent_s": round(sum(gossip) / n / window),
        "gossip_bytes_per_agent_s_max": round(max(gossip) / window),
        "overlay_bytes_per_agent_s": round(sum(wire) / n / window),
        "connections_per_agent": round(sum(connections) / n, 1),
        "connections_per_agent_max": max(connections),
        "worst_heartbeat_age_s": round(worst_age, 2) if membership != "swim" else None,
        "kill_detected_everywhere_s": round(detected, 2),
    }


def _sent(agent) -> int:
    """Bytes the agent's overlay has sent, on every connection it had (ended ones too)."""
    return sum(t["sent"] for t in agent.overlay.traffic().values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="3,10,30")
    ap.add_argument("--window", type=float, default=60.0, help="virtual seconds measured")
    ap.add_argument(
        "--settle", type=float, default=30.0, help="virtual seconds after the views are full"
    )
    ap.add_argument("--membership", choices=("heartbeat", "swim"), default="swim")
    ap.add_argument(
        "--overlay-max",
        type=int,
        default=60,
        help="with --membership swim: the largest size run over the simulated overlay; every "
        "size also runs on the message bus (bench/swim.py's measures, signed, through the codec)",
    )
    ap.add_argument("--no-bus", action="store_true", help="with --membership swim: overlay only")
    ap.add_argument("--loss-minutes", type=float, default=10.0, help="the bus's 1%% loss run")
    ap.add_argument("--out", type=Path, default=Path("bench/results/gossip.json"))
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    config = GossipConfig()
    rows: list[dict] = []
    bus_rows: list[dict] = []
    sizes = [int(x) for x in args.sizes.split(",")]
    if args.membership == "swim":
        for n in [] if args.no_bus else sizes:
            bus_rows.append(swim.run(n, args.loss_minutes, seed=1, signed=True, bounded=True))
            print(json.dumps(bus_rows[-1]), file=sys.stderr)
        sizes = [n for n in sizes if n <= args.overlay_max]
    for n in sizes:
        t = time.perf_counter()
        row = trio.run(
            run_one,
            n,
            args.window,
            config,
            args.membership,
            args.settle,
            clock=trio.testing.MockClock(autojump_threshold=0),
        )
        row["wall_s"] = round(time.perf_counter() - t, 1)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    if rows:
        print("over the simulated overlay (each agent's Noise links, streams and services):")
        result_file.print_table(rows)
    if bus_rows:
        print("on the message bus (signed members through the codec, 40 B of framing a message):")
        result_file.print_table(bus_rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "config": config.__dict__,
                "link_latency_s": 0.010,
                "window_s": args.window,
                "machine": platform.platform(),
                "results": rows,
                "bus": bus_rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
