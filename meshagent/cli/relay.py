"""`meshagent relay`: run a relay server for agents that cannot reach each other directly."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import structlog
import trio

from meshagent import logs
from meshagent.cli.common import size_arg
from meshagent.errors import ConfigError
from meshagent.net.address import Address
from meshagent.net.tcp import TcpTransport
from meshagent.relay.limits import RelayLimits
from meshagent.relay.server import RelayServer

log = structlog.get_logger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    d = RelayLimits()
    p = sub.add_parser("relay", help="run a relay server for agents without a direct path")
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="address to listen on")
    p.add_argument(
        "--observe-port",
        type=int,
        metavar="PORT",
        help="a second port on the same host, where agents learn whether their NAT maps by "
        "destination (default: the listen port + 1; a listen port of 0 picks a free one too; "
        "-1: none)",
    )
    p.add_argument(
        "--circuits-per-agent",
        metavar="N",
        type=int,
        default=d.circuits_per_agent,
        help=f"circuits one agent may be an end of at once (default {d.circuits_per_agent})",
    )
    p.add_argument(
        "--max-agents",
        metavar="N",
        type=int,
        default=d.max_agents,
        help=f"agents registered at once (default {d.max_agents})",
    )
    p.add_argument(
        "--rate",
        type=size_arg,
        default=int(d.rate_bytes_per_s),
        metavar="BYTES",
        help="bytes per second per circuit, both directions together (default 4MiB)",
    )
    p.add_argument(
        "--circuits-per-mesh",
        metavar="N",
        type=int,
        default=d.circuits_per_mesh,
        help=f"circuits among one mesh's members at once (default {d.circuits_per_mesh})",
    )
    p.add_argument(
        "--mesh-rate",
        type=size_arg,
        default=0,
        metavar="BYTES",
        help="bytes per second of all one mesh's circuits together (default 0: no cap)",
    )
    p.add_argument(
        "--report-every",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="log what the relay carries, in total and per mesh (relay.report), this often "
        "(default 60; 0: never)",
    )
    p.add_argument(
        "--report",
        type=Path,
        metavar="FILE",
        help="also write that report as JSON to FILE each time (replaced whole)",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=d.idle_timeout,
        metavar="SECONDS",
        help=f"close a circuit that moves no byte this long (default {d.idle_timeout:g})",
    )
    p.add_argument(
        "--log-level", choices=logs.LEVELS, default="info", help="the least severe events logged"
    )
    p.add_argument(
        "--log-format",
        choices=("auto", "json", "console"),
        default="auto",
        help="auto: pretty on a terminal, JSON lines otherwise",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    listen = Address.parse(args.listen)
    limits = RelayLimits(
        max_agents=args.max_agents,
        circuits_per_agent=args.circuits_per_agent,
        rate_bytes_per_s=args.rate,
        idle_timeout=args.idle_timeout,
        circuits_per_mesh=args.circuits_per_mesh,
        mesh_rate_bytes_per_s=args.mesh_rate,
    )
    limits.validate()
    logs.configure(
        args.log_level, json={"auto": None, "json": True, "console": False}[args.log_format]
    )

    async def main() -> None:
        server = RelayServer(TcpTransport(), listen, limits, observe=_observe(listen, args))
        async with trio.open_nursery() as nursery:
            try:
                address = await nursery.start(server.run)
            except OSError as e:
                raise ConfigError(f"cannot listen on {listen}: {e.strerror or e}") from e
            also = (
                f" (observing on port {server.observe_address.port})"
                if server.observe_address
                else ""
            )
            print(f"meshagent: relay listening on {address}{also}", file=sys.stderr)
            if args.report_every > 0:
                nursery.start_soon(_report, server, args.report_every, args.report)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    break
            nursery.cancel_scope.cancel()

    trio.run(main)
    return 0


def _observe(listen: Address, args: argparse.Namespace) -> Address | None:
    port = args.observe_port
    if port is None:
        port = listen.port + 1 if listen.port else 0
    if port < 0:
        return None
    if port > 65535 or (port and port == listen.port):
        raise ConfigError(f"--observe-port {port}: give a free port other than the listen port")
    return Address(listen.host, port)


async def _report(server: RelayServer, every: float, path: Path | None) -> None:
    """What the relay carries, in total and per mesh: logged, and written to `path`."""
    while True:
        await trio.sleep(every)
        stats = server.stats()
        log.info("relay.report", **stats)
        if path is not None:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(stats, indent=1))
            os.replace(tmp, path)
