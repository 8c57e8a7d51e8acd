"""Transport benchmark: the encrypted overlay against raw trio TCP, on loopback.

Measures, for each of raw TCP and the overlay (Noise handshake, ChaCha20-Poly1305 records,
multiplexed streams with credit windows):
  * throughput: SIZE MiB sent as MESSAGE-sized send_all calls on one stream, until the
    receiver (a separate process) acknowledges the last byte;
  * latency: p50/p99 of a 100-byte request answered by a 100-byte reply on one stream.

The receiver runs in a child process, so sender and receiver each have a core, as two
agents on two machines would. Prints a table and writes JSON (default
bench/results/transport.json). Never asserts on time: compare the figures yourself.

    .venv/bin/python bench/transport.py [--out PATH] [--size-mib 64] [--requests 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import trio

from meshagent import logs
from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret
from meshagent.net.config import OverlayConfig
from meshagent.net.manager import ConnectionManager
from meshagent.net.tcp import TcpTransport
from meshagent.wire.handshake import LocalPeer

HOST = "127.0.0.1"
READ = 256 * 1024
REQUEST = 100
MODE_BULK, MODE_ECHO = b"B", b"E"


# ----- receiver side (child process) -----


async def serve_bulk(stream: trio.abc.Stream) -> None:
    total = 0
    while data := await stream.receive_some(READ):
        total += len(data)
    await stream.send_all(total.to_bytes(8, "big"))


async def serve_echo(stream: trio.abc.Stream) -> None:
    buf = b""
    while True:
        data = await stream.receive_some(READ)
        if not data:
            return
        buf += data
        while len(buf) >= REQUEST:
            request, buf = buf[:REQUEST], buf[REQUEST:]
            await stream.send_all(request)


async def serve_raw(stream: trio.SocketStream) -> None:
    mode = await stream.receive_some(1)
    if mode == MODE_BULK:
        await serve_bulk(stream)
    elif mode == MODE_ECHO:
        await serve_echo(stream)
    await stream.aclose()


async def serve_overlay(stream) -> None:
    if stream.label == "bulk":
        await serve_bulk(stream)
    else:
        await serve_echo(stream)
    await stream.send_eof()


async def server(mesh_hex: str) -> None:
    local = LocalPeer.create(NodeIdentity.generate(), MeshSecret(bytes.fromhex(mesh_hex)))
    overlay = ConnectionManager(
        local, TcpTransport(), listen=[f"{HOST}:0"], on_stream=serve_overlay
    )
    async with trio.open_nursery() as nursery:
        raw_listeners = await nursery.start(trio.serve_tcp, serve_raw, 0)
        raw_port = raw_listeners[0].socket.getsockname()[1]
        [overlay_address] = await nursery.start(overlay.run)
        print(f"READY {raw_port} {overlay_address.port} {local.peer_id}", flush=True)


# ----- sender side -----


async def bulk(stream, size: int, message: int, prefix: bytes = b"") -> float:
    blob = os.urandom(message)
    start = time.perf_counter()
    if prefix:
        await stream.send_all(prefix)
    sent = 0
    while sent < size:
        await stream.send_all(blob)
        sent += message
    await stream.send_eof()
    ack = b""
    while len(ack) < 8:
        data = await stream.receive_some(8)
        if not data:
            raise RuntimeError("receiver closed before acknowledging")
        ack += data
    elapsed = time.perf_counter() - start
    if int.from_bytes(ack, "big") != size:
        raise RuntimeError(f"receiver got {int.from_bytes(ack, 'big')} of {size} bytes")
    return size / elapsed / 1e6


async def latencies(stream, count: int, warmup: int = 200) -> list[float]:
    request = os.urandom(REQUEST)
    out = []
    for i in range(count + warmup):
        start = time.perf_counter()
        await stream.send_all(request)
        got = 0
        while got < REQUEST:
            got += len(await stream.receive_some(READ))
        if i >= warmup:
            out.append(time.perf_counter() - start)
    return out


def summarise(rates: list[float], rtts: list[float]) -> dict:
    rtts = sorted(rtts)
    return {
        "throughput_mb_s": round(statistics.median(rates), 1),
        "throughput_runs_mb_s": [round(r, 1) for r in rates],
        "p50_us": round(rtts[len(rtts) // 2] * 1e6, 1),
        "p99_us": round(rtts[int(len(rtts) * 0.99)] * 1e6, 1),
    }


async def run_raw(port: int, size: int, message: int, runs: int, requests: int) -> dict:
    rates = []
    for _ in range(runs):
        stream = await trio.open_tcp_stream(HOST, port)
        rates.append(await bulk(stream, size, message, prefix=MODE_BULK))
        await stream.aclose()
    stream = await trio.open_tcp_stream(HOST, port)
    await stream.send_all(MODE_ECHO)
    rtts = await latencies(stream, requests)
    await stream.aclose()
    return summarise(rates, rtts)


async def run_overlay(
    port: int, peer_id: str, mesh: MeshSecret, size: int, message: int, runs: int, requests: int
) -> dict:
    local = LocalPeer.create(NodeIdentity.generate(), mesh)
    manager = ConnectionManager(local, TcpTransport(), config=OverlayConfig())
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        start = time.perf_counter()
        await manager.dial(f"{HOST}:{port}", peer_id=peer_id)
        connect_ms = (time.perf_counter() - start) * 1e3
        rates = []
        for _ in range(runs):
            stream = await manager.open_stream(peer_id, "bulk")
            rates.append(await bulk(stream, size, message))
            await stream.aclose()
        stream = await manager.open_stream(peer_id, "echo")
        rtts = await latencies(stream, requests)
        await stream.send_eof()
        await stream.aclose()
        nursery.cancel_scope.cancel()
    result = summarise(rates, rtts)
    result["connect_ms"] = round(connect_ms, 2)
    return result


async def client(args: argparse.Namespace) -> dict:
    mesh = MeshSecret.generate()
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", mesh.value.hex()],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline().split()
        if not line or line[0] != "READY":
            raise RuntimeError("benchmark receiver failed to start")
        raw_port, overlay_port, peer_id = int(line[1]), int(line[2]), line[3]
        size, message = args.size_mib << 20, args.message_kib << 10
        raw = await run_raw(raw_port, size, message, args.runs, args.requests)
        overlay = await run_overlay(
            overlay_port, peer_id, mesh, size, message, args.runs, args.requests
        )
    finally:
        child.terminate()
        child.wait(timeout=10)
    return {
        "benchmark": "transport",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "params": {
            "bytes": size,
            "message_bytes": message,
            "runs": args.runs,
            "requests": args.requests,
            "request_bytes": REQUEST,
        },
        "raw_tcp": raw,
        "overlay": overlay,
        "ratios": {
            "throughput": round(overlay["throughput_mb_s"] / raw["throughput_mb_s"], 2),
            "p50": round(overlay["p50_us"] / raw["p50_us"], 2),
            "p99": round(overlay["p99_us"] / raw["p99_us"], 2),
        },
    }


def print_table(result: dict) -> None:
    raw, ov, ratio = result["raw_tcp"], result["overlay"], result["ratios"]
    p = result["params"]
    print(
        f"loopback, {p['bytes'] >> 20} MiB in {p['message_bytes'] >> 10} KiB messages "
        f"(median of {p['runs']}), {p['requests']} x {p['request_bytes']}-byte request/reply"
    )
    print(f"{'':22}{'raw TCP':>12}{'overlay':>12}{'overlay/raw':>14}")
    rows = [
        ("throughput (MB/s)", "throughput_mb_s", "throughput"),
        ("p50 latency (us)", "p50_us", "p50"),
        ("p99 latency (us)", "p99_us", "p99"),
    ]
    for label, key, rkey in rows:
        print(f"{label:22}{raw[key]:>12}{ov[key]:>12}{ratio[rkey]:>14}")
    print(f"{'connect+handshake (ms)':22}{'':>12}{ov['connect_ms']:>12}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/transport.json")
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--message-kib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logs.configure("warning", json=False)
    if args.serve:
        trio.run(server, args.serve)
        return 0
    result = trio.run(client, args)
    print_table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
