"""`meshagent invite`: print a token that lets another agent join this mesh."""

from __future__ import annotations

import argparse
import sys

from meshagent.cli.common import NoAgent, add_data_dir, control_get, data_dir_from
from meshagent.config import AgentConfig
from meshagent.discovery.addresses import advertised
from meshagent.errors import MeshError
from meshagent.identity.mesh import Invite, encode_invite
from meshagent.identity.mesh_file import load_mesh
from meshagent.net.address import Address, is_loopback


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("invite", help="print an invite token for this mesh")
    p.add_argument(
        "--address",
        action="append",
        metavar="HOST:PORT",
        help="an overlay address the new agent should dial (repeatable; default: the addresses "
        "the running agent advertises to its peers)",
    )
    p.add_argument(
        "--relay",
        action="append",
        metavar="HOST:PORT",
        help="a relay to carry (repeatable), besides those the running agent is registered with",
    )
    add_data_dir(p)
    p.set_defaults(run=run)


def _from_agent(args: argparse.Namespace) -> tuple[list[str], list[str]] | None:
    """The running agent's advertised addresses (those its gossip record carries) and the
    relays it is registered with; None: no agent runs (or it does not answer)."""
    try:
        st = control_get(args, "/control/status")
    except MeshError:
        return None
    relays = [r["address"] for r in st.get("relays", []) if r.get("registered")]
    return list(st.get("advertised", [])), relays


def run(args: argparse.Namespace) -> int:
    dd = data_dir_from(args)
    if not dd.mesh_path.exists():
        raise NoAgent(
            f"no mesh in {dd.root} yet: start an agent once with `meshagent up` to create one"
        )
    secret = load_mesh(dd.mesh_path)
    addresses = list(args.address or [])
    relays = list(args.relay or [])
    notes = []
    if not addresses:
        running = _from_agent(args)
        if running is not None:
            addresses, registered = running
            relays += [r for r in registered if r not in relays]
        else:
            # No agent runs (or it is still starting): the address it listens on is in its
            # configuration, unless that picks a free port at each start.
            config = AgentConfig().merged(dd.load_config())
            relays += [r for r in config.relays if r not in relays]
            if Address.parse(config.listen).port:
                addresses = advertised([Address.parse(config.listen)], config.addresses)
                notes.append(
                    "no agent is running yet; the token carries this host's addresses at the "
                    f"configured listen port ({config.listen}): start the agent before the "
                    "other one joins"
                )
            else:
                notes.append(
                    "no agent is running and its listen port is picked at start, so the token "
                    "carries no address; pass --address HOST:PORT or start the agent first"
                )
    for a in (*addresses, *relays):
        Address.parse(a)  # refuse typos now, not on the other machine
    if addresses and not relays and all(is_loopback(Address.parse(a).host) for a in addresses):
        notes.append(
            f"the token holds only loopback addresses ({', '.join(addresses)}): an agent on "
            "another machine cannot use it. Start the agent with --listen 0.0.0.0:PORT (or "
            "this host's address), or pass --address HOST:PORT (an address the other machine "
            "reaches) or --relay HOST:PORT"
        )
    token = encode_invite(Invite(secret, tuple(addresses), tuple(relays)))
    print(token)
    for note in notes:
        print(f"meshagent: note: {note}", file=sys.stderr)
    return 0
