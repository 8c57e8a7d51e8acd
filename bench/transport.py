"""Transport benchmark: the encrypted overlay against raw trio TCP, on loopback.

Measures, for each of raw TCP and the overlay (Noise handshake, encrypted records,
multiplexed streams with credit windows), the overlay twice: with the record cipher the two
ends negotiate (AES-256-GCM where the CPU has AES instructions) and with ChaCha20-Poly1305
forced (what a peer without fast AES gets):
  * throughput: SIZE MiB sent as MESSAGE-sized send_all calls on one stream, until the
    receiver (a separate process) acknowledges the last byte;
  * latency: p50/p99 of a 100-byte request answered by a 100-byte reply on one stream.
It also measures each record cipher alone on one core and prints the throughput ratio that
cipher speed allows here: each end of the overlay does what its raw counterpart does plus
one AEAD pass over every byte, so where raw TCP keeps each end's core busy the overlay can
reach at most C / (C + R) of raw (C: the cipher's rate, R: raw TCP's rate). A goal above that
ceiling needs a faster cipher (a CPU with wider AES units), not a leaner overlay.

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
from meshagent.wire.ciphers import CHACHAPOLY, aead_for, preferred
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


async def latencies(stream, count: int, warmup: int) -> list[float]:
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


def aead_mb_s(cipher: str, record: int = 256 * 1024, seconds: float = 0.3) -> float:
    """One core sealing `record`-byte records with `cipher` (MB/s, best of three tries)."""
    aead = aead_for(cipher, os.urandom(32))
    plaintext, out = os.urandom(record), bytearray(record + 16)
    nonce, best = bytes(12), 0.0
    for _ in range(3):
        n, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds / 3:
            aead.encrypt_into(nonce, plaintext, b"", out)
            n += 1
        best = max(best, n * record / elapsed / 1e6)
    return best


def summarise(rates: list[float], rtts: list[float]) -> dict:
    rtts = sorted(rtts)
    return {
        "throughput_mb_s": round(statistics.median(rates), 1),
        "throughput_runs_mb_s": [round(r, 1) for r in rates],
        "p50_us": round(rtts[len(rtts) // 2] * 1e6, 1),
        "p99_us": round(rtts[int(len(rtts) * 0.99)] * 1e6, 1),
    }


class RawContender:
    """Raw trio TCP: a new connection per bulk run (EOF ends it), one for request/reply."""

    name = "raw"

    def __init__(self, port: int) -> None:
        self.port = port
        self.echo: trio.abc.Stream | None = None

    async def bulk(self, size: int, message: int) -> float:
        stream = await trio.open_tcp_stream(HOST, self.port)
        try:
            return await bulk(stream, size, message, prefix=MODE_BULK)
        finally:
            await stream.aclose()

    async def echo_stream(self) -> trio.abc.Stream:
        if self.echo is None:
            self.echo = await trio.open_tcp_stream(HOST, self.port)
            await self.echo.send_all(MODE_ECHO)
        return self.echo


class OverlayContender:
    """The overlay: one connection (one handshake), a new stream per bulk run."""

    def __init__(self, manager: ConnectionManager, peer_id: str, connect_ms: float) -> None:
        self.manager, self.peer_id, self.connect_ms = manager, peer_id, connect_ms
        self.cipher = manager.connection(peer_id).cipher
        self.name = f"overlay {self.cipher}"
        self.echo = None

    async def bulk(self, size: int, message: int) -> float:
        stream = await self.manager.open_stream(self.peer_id, "bulk")
        try:
            return await bulk(stream, size, message)
        finally:
            await stream.aclose()

    async def echo_stream(self):
        if self.echo is None:
            self.echo = await self.manager.open_stream(self.peer_id, "echo")
        return self.echo


async def overlay_contender(
    nursery: trio.Nursery, port: int, peer_id: str, mesh: MeshSecret, ciphers: tuple[str, ...]
) -> OverlayContender:
    local = LocalPeer.create(NodeIdentity.generate(), mesh, record_ciphers=ciphers)
    manager = ConnectionManager(local, TcpTransport(), config=OverlayConfig())
    await nursery.start(manager.run)
    start = time.perf_counter()
    await manager.dial(f"{HOST}:{port}", peer_id=peer_id)
    return OverlayContender(manager, peer_id, (time.perf_counter() - start) * 1e3)


async def measure(contenders: list, args: argparse.Namespace) -> list[dict]:
    """Every contender's runs interleaved (raw, overlay, overlay, raw, ...), so a change
    in what else the machine is doing touches all of them alike."""
    size, message = args.size_mib << 20, args.message_kib << 10
    rates: list[list[float]] = [[] for _ in contenders]
    rtts: list[list[float]] = [[] for _ in contenders]
    for _ in range(args.runs):
        for i, c in enumerate(contenders):
            rates[i].append(await c.bulk(size, message))
    blocks = 5
    for block in range(blocks):
        for i, c in enumerate(contenders):
            warmup = 200 if block == 0 else 20
            rtts[i] += await latencies(await c.echo_stream(), args.requests // blocks, warmup)
    return [summarise(r, t) for r, t in zip(rates, rtts, strict=True)]


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
        async with trio.open_nursery() as nursery:
            negotiated = await overlay_contender(nursery, overlay_port, peer_id, mesh, preferred())
            chacha = await overlay_contender(nursery, overlay_port, peer_id, mesh, (CHACHAPOLY,))
            contenders = [RawContender(raw_port), negotiated, chacha]
            raw, overlay, overlay_chacha = await measure(contenders, args)
            nursery.cancel_scope.cancel()
        for result, c in ((overlay, negotiated), (overlay_chacha, chacha)):
            result["connect_ms"] = round(c.connect_ms, 2)
            result["cipher"] = c.cipher
            result["aead_mb_s"] = round(aead_mb_s(c.cipher), 1)
        size, message = args.size_mib << 20, args.message_kib << 10
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
        "overlay_chachapoly": overlay_chacha,
        "ratios": ratios(overlay, raw),
        "ratios_chachapoly": ratios(overlay_chacha, raw),
    }


def ratios(overlay: dict, raw: dict) -> dict:
    """Ratios of the medians, and of each run to the raw run next to it (the interleaving
    makes each pair see the same machine; their median and range show how steady it was)."""
    pairs = [
        o / r
        for o, r in zip(overlay["throughput_runs_mb_s"], raw["throughput_runs_mb_s"], strict=True)
    ]
    return {
        "throughput": round(overlay["throughput_mb_s"] / raw["throughput_mb_s"], 2),
        "throughput_pairs": [round(x, 2) for x in pairs],
        "throughput_pairs_median": round(statistics.median(pairs), 2),
        "p50": round(overlay["p50_us"] / raw["p50_us"], 2),
        "p99": round(overlay["p99_us"] / raw["p99_us"], 2),
        # What cipher speed alone allows (see the module docstring).
        "throughput_ceiling": round(
            overlay["aead_mb_s"] / (overlay["aead_mb_s"] + raw["throughput_mb_s"]), 2
        ),
    }


def print_table(result: dict) -> None:
    raw, ov, cc = result["raw_tcp"], result["overlay"], result["overlay_chachapoly"]
    ratio, cratio = result["ratios"], result["ratios_chachapoly"]
    p = result["params"]
    print(
        f"loopback, {p['bytes'] >> 20} MiB in {p['message_bytes'] >> 10} KiB messages "
        f"(median of {p['runs']}), {p['requests']} x {p['request_bytes']}-byte request/reply"
    )
    a, b = f"overlay {ov['cipher']}", f"overlay {cc['cipher']}"
    print(f"{'':24}{'raw TCP':>10}{a:>19}{'/raw':>7}{b:>23}{'/raw':>7}")
    rows = [
        ("throughput (MB/s)", "throughput_mb_s", "throughput"),
        ("p50 latency (us)", "p50_us", "p50"),
        ("p99 latency (us)", "p99_us", "p99"),
    ]
    for label, key, rkey in rows:
        print(
            f"{label:24}{raw[key]:>10}{ov[key]:>19}{ratio[rkey]:>7}{cc[key]:>23}{cratio[rkey]:>7}"
        )
    print(
        f"{'connect+handshake (ms)':24}{'':>10}{ov['connect_ms']:>19}{'':>7}{cc['connect_ms']:>23}"
    )
    for name, r in ((ov["cipher"], ratio), (cc["cipher"], cratio)):
        pairs = r["throughput_pairs"]
        print(
            f"throughput of each {name} run / the raw run beside it: median "
            f"{r['throughput_pairs_median']}, range {min(pairs)}-{max(pairs)}"
        )
    for x, r in ((ov, ratio), (cc, cratio)):
        print(
            f"{x['cipher']} alone on one core: {x['aead_mb_s']} MB/s; the throughput ratio "
            f"that allows here: at most {r['throughput_ceiling']}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/transport.json")
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--message-kib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=5)
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
