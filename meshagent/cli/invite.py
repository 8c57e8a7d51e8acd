"""`meshagent invite`: print a token that lets another agent join this mesh."""

from __future__ import annotations

import argparse
import json
import socket
import sys

from meshagent.cli.common import NoAgent, add_data_dir, data_dir_from
from meshagent.config import AgentConfig
from meshagent.identity.mesh import Invite, encode_invite
from meshagent.identity.mesh_file import load_mesh
from meshagent.net.address import Address


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("invite", help="print an invite token for this mesh")
    p.add_argument(
        "--address",
        action="append",
        metavar="HOST:PORT",
        help="an overlay address the new agent should dial (repeatable; default: the running "
        "agent's listen addresses)",
    )
    p.add_argument(
        "--relay", action="append", metavar="HOST:PORT", help="a relay to carry (repeatable)"
    )
    add_data_dir(p)
    p.set_defaults(run=run)


def _advertised(listen: list[str]) -> list[str]:
    """Listen addresses a peer can dial: a wildcard host becomes this host's addresses."""
    out: list[str] = []
    for text in listen:
        a = Address.parse(text)
        if a.host in ("0.0.0.0", "::", ""):
            try:
                hosts = socket.gethostbyname_ex(socket.gethostname())[2]
            except OSError:
                hosts = []
            hosts = [h for h in hosts if not h.startswith("127.")] or ["127.0.0.1"]
            out += [str(Address(h, a.port)) for h in hosts]
        else:
            out.append(str(a))
    return out


def run(args: argparse.Namespace) -> int:
    dd = data_dir_from(args)
    if not dd.mesh_path.exists():
        raise NoAgent(
            f"no mesh in {dd.root} yet: start an agent once with `meshagent up` to create one"
        )
    secret = load_mesh(dd.mesh_path)
    addresses = list(args.address or [])
    note = ""
    if not addresses:
        try:
            addresses = _advertised(json.loads(dd.run_path.read_text()).get("listen", []))
        except (OSError, ValueError):
            # No agent runs (or it is still starting): the address it listens on is in its
            # configuration, unless that picks a free port at each start.
            listen = AgentConfig().merged(dd.load_config()).listen
            if Address.parse(listen).port:
                addresses = _advertised([listen])
                note = (
                    f"meshagent: note: no agent is running yet; the token carries this host's "
                    f"addresses at the configured listen port ({listen}): start the agent "
                    "before the other one joins"
                )
            else:
                note = (
                    "meshagent: note: no agent is running and its listen port is picked at "
                    "start, so the token carries no address; pass --address HOST:PORT or "
                    "start the agent first"
                )
    for a in addresses:
        Address.parse(a)  # refuse typos now, not on the other machine
    token = encode_invite(Invite(secret, tuple(addresses), tuple(args.relay or ())))
    print(token)
    if note:
        print(note, file=sys.stderr)
    return 0
