"""`meshagent` entry point: parses the command line and dispatches to a subcommand."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from meshagent import __version__, logs
from meshagent.cli import doctor, invite, models, peers, relay, status, up
from meshagent.errors import MeshError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshagent",
        description="Run large language models across the machines you already have.",
    )
    parser.add_argument("--version", action="version", version=f"meshagent {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    up.register(sub)
    status.register(sub)
    invite.register(sub)
    models.register(sub)
    peers.register(sub)
    relay.register(sub)
    doctor.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command not in ("up", "relay"):  # these set up logging from their flags
        logs.configure("info", json=False)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (MeshError, BaseExceptionGroup) as e:
        # Errors raised inside trio nurseries arrive wrapped in exception groups.
        found = _mesh_error(e)
        if found is None:
            raise
        print(f"meshagent: error: {found}", file=sys.stderr)
        return 1


def _mesh_error(e: BaseException) -> MeshError | None:
    if isinstance(e, MeshError):
        return e
    if isinstance(e, BaseExceptionGroup):
        for inner in e.exceptions:
            found = _mesh_error(inner)
            if found is not None:
                return found
    return None


if __name__ == "__main__":
    raise SystemExit(main())
