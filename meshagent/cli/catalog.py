"""`meshagent models add|remove|catalog`: the mesh's catalogue of models, changed and read
through the running agent of the data dir (its control API, with its API key)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from meshagent.cli.common import add_data_dir, control_call
from meshagent.models.names import parse_model_name
from meshagent.wording import size

_ADD_TIMEOUT = None  # a hub model downloads on the agent first: as long as that takes


def register(msub: argparse._SubParsersAction) -> None:
    a = msub.add_parser(
        "add",
        help="add a model to the mesh's catalogue (through the running agent): every agent "
        "lists it, and the mesh can place it",
    )
    a.add_argument(
        "model",
        metavar="PATH|NAME",
        help="a GGUF file on this machine, or a Hugging Face name: ORG/REPO, ORG/REPO:QUANT "
        "or ORG/REPO/FILE.gguf (downloaded by the agent first)",
    )
    a.add_argument("--json", action="store_true", help="print the signed entry as JSON")
    _agent_flags(a)
    a.set_defaults(run=run_add)

    r = msub.add_parser("remove", help="remove a model from the mesh's catalogue")
    r.add_argument("name", help="the model's name, as `meshagent models catalog` lists it")
    r.add_argument("--json", action="store_true", help="print the signed tombstone as JSON")
    _agent_flags(r)
    r.set_defaults(run=run_remove)

    c = msub.add_parser("catalog", help="list the mesh's catalogue of models")
    c.add_argument("--json", action="store_true", help="print the catalogue as JSON")
    _agent_flags(c)
    c.set_defaults(run=run_catalog)


def _agent_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api", metavar="URL", help="the agent's API URL (default: read from the data dir)"
    )
    add_data_dir(p)


def run_add(args: argparse.Namespace) -> int:
    spec = args.model
    name = parse_model_name(spec)  # ModelError for what is neither a path nor a name
    if isinstance(name, Path):
        # The agent runs elsewhere in the file system: a path goes to it absolute.
        spec = str(name.expanduser().absolute())
    entry = control_call(args, "POST", "/control/models", {"model": spec}, timeout=_ADD_TIMEOUT)
    if args.json:
        print(json.dumps(entry, indent=2))
    else:
        print(
            f"added {entry['name']} to the mesh's catalogue ({size(entry['size'])}, "
            f"{entry['layers']} layers, sha256 {entry['sha256'][:16]}, version "
            f"{entry['version']})"
        )
    return 0


def run_remove(args: argparse.Namespace) -> int:
    path = "/control/models/" + quote(args.name, safe="")
    entry = control_call(args, "DELETE", path)
    if args.json:
        print(json.dumps(entry, indent=2))
    else:
        print(f"removed {entry['name']} from the mesh's catalogue (version {entry['version']})")
    return 0


def run_catalog(args: argparse.Namespace) -> int:
    body = control_call(args, "GET", "/control/models")
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    print(table(body["models"]))
    return 0


def table(models: list[dict[str, Any]]) -> str:
    """The catalogue as `meshagent models catalog` prints it."""
    if not models:
        return "the mesh's catalogue is empty (add a model with `meshagent models add`)"
    head = ("NAME", "SIZE", "LAYERS", "SHA256", "ADDED BY", "ADDED", "SOURCE")
    rows = [
        (
            m["name"],
            size(m["size"]),
            str(m["layers"]),
            m["sha256"][:12],
            m["author"][:12],
            time.strftime("%Y-%m-%d %H:%M", time.localtime(m["added_at"])),
            m["source"] or "(embedded default)",
        )
        for m in models
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head) - 1)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
        for r in [head, *rows]
    )
