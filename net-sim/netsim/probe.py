"""Small traffic tools to run inside lab hosts: UDP ping and echo, UDP flood and sink, a TCP
transfer, multicast send and receive. Each prints one JSON object on stdout when done (servers
first print a `ready` line once bound), so tests and `limits.py` read results without parsing.

    python -m netsim.probe udp-echo --port 7000
    python -m netsim.probe udp-ping 10.77.0.2 7000 --count 100
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import struct
import sys
import time
from typing import Any


def command(*args: str) -> list[str]:
    """The argv that runs this tool with `args` (needs only the standard library)."""
    return [sys.executable, __file__, *args]


def _emit(result: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def _ready() -> None:
    sys.stdout.write("ready\n")
    sys.stdout.flush()


def udp_echo(args: argparse.Namespace) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", args.port))
    _ready()
    while True:
        data, peer = s.recvfrom(65536)
        s.sendto(data, peer)


def udp_ping(args: argparse.Namespace) -> None:
    """Sequential pings: each waits for its echo (or `timeout`) before the next is sent."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((args.host, args.port))
    s.settimeout(args.timeout)
    pad = b"\0" * max(0, args.size - 12)
    rtts, lost = [], 0
    for seq in range(args.count):
        sent = time.perf_counter()
        s.send(struct.pack(">Id", seq, sent) + pad)
        deadline = sent + args.timeout
        while True:
            try:
                data = s.recv(65536)
            except (TimeoutError, ConnectionRefusedError):
                lost += 1
                break
            got_seq, got_sent = struct.unpack_from(">Id", data)
            if got_seq == seq:
                rtts.append((time.perf_counter() - got_sent) * 1000)
                break
            s.settimeout(max(0.001, deadline - time.perf_counter()))  # a late echo: skip it
        s.settimeout(args.timeout)
        if args.interval:
            time.sleep(args.interval)
    _emit({"rtts_ms": rtts, "lost": lost, "sent": args.count})


def udp_flood(args: argparse.Namespace) -> None:
    """Send `size`-byte datagrams for `seconds`, at `rate` per second (0: as fast as possible)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((args.host, args.port))
    payload = b"\0" * args.size
    sent = errors = 0
    start = time.perf_counter()
    end = start + args.seconds
    gap = 1.0 / args.rate if args.rate else 0.0
    next_at = start
    while True:
        now = time.perf_counter()
        if now >= end:
            break
        if gap:
            if now < next_at:
                time.sleep(min(next_at - now, 0.01))
                continue
            next_at += gap
        try:
            s.send(payload)
            sent += 1
        except OSError:  # ENOBUFS when the device queue is full: counted, not fatal
            errors += 1
    _emit({"sent": sent, "errors": errors, "seconds": time.perf_counter() - start})


def udp_sink(args: argparse.Namespace) -> None:
    """Count datagrams until `idle` seconds pass without one (after the first)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    s.bind(("0.0.0.0", args.port))
    _ready()
    received = nbytes = 0
    first = last = None
    s.settimeout(args.wait)
    while True:
        try:
            data = s.recv(65536)
        except TimeoutError:
            break
        last = time.perf_counter()
        first = first or last
        received += 1
        nbytes += len(data)
        s.settimeout(args.idle)
    span = (last - first) if first and last else 0.0
    _emit({"received": received, "bytes": nbytes, "seconds": span})


def _pattern(n: int) -> bytes:
    """Deterministic, incompressible-looking bytes, so a corrupted transfer shows."""
    out = bytearray()
    block = 0
    while len(out) < n:
        out += hashlib.sha256(block.to_bytes(8, "big")).digest()
        block += 1
    return bytes(out[:n])


def tcp_sink(args: argparse.Namespace) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", args.port))
    srv.listen(1)
    _ready()
    conn, _ = srv.accept()
    digest = hashlib.sha256()
    total = 0
    start = time.perf_counter()
    buf = bytearray(1 << 20)
    while True:
        n = conn.recv_into(buf)
        if not n:
            break
        digest.update(memoryview(buf)[:n])
        total += n
    _emit({"bytes": total, "sha256": digest.hexdigest(), "seconds": time.perf_counter() - start})


def tcp_send(args: argparse.Namespace) -> None:
    """Send `bytes` of a fixed pattern, or repeat a 1 MiB block for `seconds`."""
    s = socket.create_connection((args.host, args.port), timeout=30)
    digest = hashlib.sha256()
    total = 0
    start = time.perf_counter()
    if args.seconds:
        block = _pattern(1 << 20)
        while time.perf_counter() - start < args.seconds:
            s.sendall(block)
            digest.update(block)
            total += len(block)
    else:
        data = _pattern(args.bytes)
        s.sendall(data)
        digest.update(data)
        total = len(data)
    s.shutdown(socket.SHUT_WR)
    s.recv(1)  # the sink closes after reading everything: the transfer is complete
    _emit({"bytes": total, "sha256": digest.hexdigest(), "seconds": time.perf_counter() - start})


def mcast_send(args: argparse.Namespace) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
    for i in range(args.count):
        s.sendto(f"mcast {i}".encode(), (args.group, args.port))
        time.sleep(args.interval)
    _emit({"sent": args.count})


def mcast_recv(args: argparse.Namespace) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", args.port))
    mreq = socket.inet_aton(args.group) + socket.inet_aton("0.0.0.0")
    s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
    _ready()
    received = 0
    end = time.monotonic() + args.seconds
    while (left := end - time.monotonic()) > 0:
        s.settimeout(left)
        try:
            s.recv(65536)
        except TimeoutError:
            break
        received += 1
    _emit({"received": received})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="netsim.probe", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("udp-echo")
    c.add_argument("--port", type=int, required=True)
    c.set_defaults(fn=udp_echo)

    c = sub.add_parser("udp-ping")
    c.add_argument("host")
    c.add_argument("port", type=int)
    c.add_argument("--count", type=int, default=100)
    c.add_argument("--interval", type=float, default=0.0)
    c.add_argument("--size", type=int, default=64)
    c.add_argument("--timeout", type=float, default=1.0)
    c.set_defaults(fn=udp_ping)

    c = sub.add_parser("udp-flood")
    c.add_argument("host")
    c.add_argument("port", type=int)
    c.add_argument("--seconds", type=float, default=2.0)
    c.add_argument("--size", type=int, default=64)
    c.add_argument("--rate", type=float, default=0.0)
    c.set_defaults(fn=udp_flood)

    c = sub.add_parser("udp-sink")
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--wait", type=float, default=30.0, help="for the first datagram")
    c.add_argument("--idle", type=float, default=1.0, help="then, between datagrams")
    c.set_defaults(fn=udp_sink)

    c = sub.add_parser("tcp-sink")
    c.add_argument("--port", type=int, required=True)
    c.set_defaults(fn=tcp_sink)

    c = sub.add_parser("tcp-send")
    c.add_argument("host")
    c.add_argument("port", type=int)
    c.add_argument("--bytes", type=int, default=4 << 20)
    c.add_argument("--seconds", type=float, default=0.0)
    c.set_defaults(fn=tcp_send)

    c = sub.add_parser("mcast-send")
    c.add_argument("group")
    c.add_argument("port", type=int)
    c.add_argument("--count", type=int, default=5)
    c.add_argument("--interval", type=float, default=0.05)
    c.set_defaults(fn=mcast_send)

    c = sub.add_parser("mcast-recv")
    c.add_argument("group")
    c.add_argument("port", type=int)
    c.add_argument("--seconds", type=float, default=2.0)
    c.set_defaults(fn=mcast_recv)

    args = p.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
