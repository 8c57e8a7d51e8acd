"""Helpers for gossip tests: tables of nodes that exchange in memory, no I/O."""

from __future__ import annotations

from meshagent.gossip.config import GossipConfig
from meshagent.gossip.exchange import Exchange
from meshagent.gossip.hearsay import Heard
from meshagent.gossip.state import Change, GossipState
from meshagent.identity.keys import NodeIdentity

MESH = "testmeshfingerprint"
FAST = GossipConfig(interval=1.0, suspect_after=3.0, dead_after=6.0, forget_after=100.0)


def make_state(
    name: str = "n",
    *,
    now: float = 0.0,
    config: GossipConfig = FAST,
    heard: Heard | None = None,
    **fields,
) -> GossipState:
    """A node that has published a record (`name`, `fields`) and beaten once; `heard` says
    when it last heard a peer directly (None: it hears nobody)."""
    st = GossipState(NodeIdentity.generate(), MESH, config, now=now, heard=heard)
    st.publish(wall_time=1000.0 + now, name=name, **fields)
    st.beat(now=now, wall_time=1000.0 + now)
    return st


def exchange(a: GossipState, b: GossipState, *, now: float) -> tuple[list[Change], list[Change]]:
    """A full push-pull exchange, a initiating; returns (changes at a, changes at b)."""
    ia = Exchange(a, initiator=True, source=b.self_id)
    rb = Exchange(b, initiator=False, source=a.self_id)
    msg = ia.start()
    msg = rb.receive_data(msg, now=now)
    msg = ia.receive_data(msg, now=now)
    assert ia.done
    assert rb.receive_data(msg, now=now) == b""
    assert rb.done
    return ia.changes, rb.changes
