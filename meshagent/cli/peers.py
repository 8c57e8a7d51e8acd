"""`meshagent peers`: the mesh as the local agent sees it (from gossip and its links)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import httpx

from meshagent.cli.common import (
    NoAgent,
    add_data_dir,
    auth_headers,
    control_get,
    data_dir_from,
    size_arg,
)
from meshagent.wording import layer_range, not_served, peer, peer_label, size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("peers", help="show the peers of the mesh: path, RTT, state, capacity")
    p.add_argument("--json", action="store_true", help="print the raw peer list as JSON")
    p.add_argument(
        "--watch",
        nargs="?",
        const=2.0,
        type=float,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C",
    )
    p.add_argument(
        "--probe",
        metavar="PEER",
        help="send bytes to a connected peer (its name, its id or a unique start of the id) "
        "and check they all arrive",
    )
    p.add_argument(
        "--probe-bytes",
        metavar="SIZE",
        type=size_arg,
        default=8_000_000,
        help="bytes to send, e.g. 8M or 500k (default 8M)",
    )
    p.add_argument(
        "--probe-seconds",
        metavar="SECONDS",
        type=float,
        default=0.0,
        help="spread the probe over this many seconds (default: as fast as possible)",
    )
    p.add_argument(
        "--api", metavar="URL", help="the agent's API URL (default: read from the data dir)"
    )
    add_data_dir(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.probe:
        return _probe(args)
    if args.watch is None:
        _show(args)
        return 0
    try:
        while True:
            if sys.stdout.isatty():
                print("\x1b[2J\x1b[H", end="")
            _show(args)
            sys.stdout.flush()
            time.sleep(max(0.2, args.watch))
    except KeyboardInterrupt:
        return 0


def _show(args: argparse.Namespace) -> None:
    body = control_get(args, "/control/peers")
    if args.json:
        print(json.dumps(body, indent=2))
        return
    print(table(body["peers"]))
    alive = sum(p["state"] == "alive" for p in body["peers"])
    print(f"{len(body['peers'])} peers ({alive} alive) in mesh {body['mesh']}")
    if body.get("alone"):
        print(body["alone"])
    for model, p in body.get("placement", {}).items():
        if not p["routable"] and p["error"]:
            print(not_served(model, p["error"]))


def table(peers: list[dict[str, Any]]) -> str:
    head = (
        "NAME",
        "PEER",
        "STATE",
        "PATH",
        "ADDRESS",
        "RTT",
        "MEMORY W+KV",
        "SPEED",
        "VRAM",
        "GPU SPEED",
        "ARTIFACTS",
        "SERVES",
    )
    rows = [head]
    for p in peers:
        rtt = "-"
        if p["rtt_ms"] is not None:
            rtt = f"{p['rtt_ms']:.1f}ms"
        elif p.get("rtt_est_ms") is not None:  # not connected: the coordinates' estimate
            rtt = f"~{p['rtt_est_ms']:.0f}ms"
        mem = "-"
        if p["mem_weights_bytes"] is not None:
            mem = f"{size(p['mem_weights_bytes'])}+{size(p['mem_kv_bytes'])}"
        speed = "-" if not p["compute_speed"] else f"{p['compute_speed']:.0f}GF"
        vram, gpu_speed = _gpus(p.get("devices") or [])
        serves = [f"{s['model']} {layer_range(*s['layers'])}" for s in p["serving"]]
        rows.append(
            (
                (p["name"] or "?") + (" (this)" if p["self"] else ""),
                p["peer_id"][:12],
                p["state"],
                p["path"] or "-",
                p["address"] or "-",
                rtt,
                mem,
                speed,
                vram,
                gpu_speed,
                str(len(p["stages"])),
                ", ".join(serves) or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    table = "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
        for r in rows
    )
    names = {p["peer_id"]: p["name"] or "" for p in peers}
    why = [
        f"{peer_label(p['peer_id'], names)} relayed: {p['why_relayed']}"
        for p in peers
        if p.get("why_relayed")
    ]
    return "\n".join([table, *why])


def _gpus(devices: list[dict[str, Any]]) -> tuple[str, str]:
    """A peer's GPUs as two cells: memory offered of the total ("20.0 GB/80.0 GB", "+"
    between devices) and each one's measured speed ("-" until measured, or without a GPU)."""
    if not devices:
        return "-", "-"
    vram = "+".join(f"{size(d['offer_bytes'])}/{size(d['total_bytes'])}" for d in devices)
    speed = "+".join(f"{d['speed']:.0f}GF" if d["speed"] else "-" for d in devices)
    return vram, speed


def _probe(args: argparse.Namespace) -> int:
    url = getattr(args, "api", None)
    if not url:
        control_get(args, "/health")  # the clear "no agent is running" message
        url = json.loads(data_dir_from(args).run_path.read_text())["api"]
    try:
        r = httpx.post(
            f"{url}/control/probe",
            json={"peer": args.probe, "bytes": args.probe_bytes, "seconds": args.probe_seconds},
            headers=auth_headers(data_dir_from(args)),
            timeout=max(60.0, args.probe_seconds * 2 + 30),
        )
    except httpx.HTTPError as e:
        raise NoAgent(f"the agent at {url} does not answer ({e}); is it running?") from e
    body = r.json()
    if r.status_code != 200:
        raise NoAgent(f"probe failed: {body.get('error', {}).get('message', body)}")
    if args.json:
        print(json.dumps(body, indent=2))
    else:
        verdict = "ok" if body["ok"] else "MISMATCH"
        who = peer(body["peer_id"], body.get("name", ""))
        print(
            f"probe {who}: {verdict}, {body['bytes']} bytes in "
            f"{body['seconds']} s ({body['mbit_per_s']} Mbit/s) over {body['path']}"
            + (f", now {body['path_after']}" if body["path_after"] != body["path"] else "")
        )
    return 0 if body["ok"] else 1
