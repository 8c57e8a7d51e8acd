"""Measure the link emulator's own limits on this machine: the latency it adds when idle, the
packets per second it forwards, and the TCP throughput it carries through a rate-limited link.
Prints a table and writes JSON (default net-sim/reports/limits.json). Needs root; never asserts.

    sudo .venv/bin/python net-sim/limits.py [--out PATH] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from netsim import probe
from netsim.lab import Lab, check_requirements
from netsim.linkmodel import LinkSpec
from netsim.regimes import MBIT, Topology

ECHO_PORT = 7000
SINK_PORT = 7001
TCP_PORT = 7002


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(rtts: list[float]) -> dict[str, float]:
    return {
        "p50_ms": statistics.median(rtts),
        "p99_ms": _percentile(rtts, 0.99),
        "min_ms": min(rtts),
        "max_ms": max(rtts),
    }


def measure_rtt(lab: Lab, delays_ms: list[float], count: int) -> list[dict]:
    """Sequential UDP pings h0 -> h1 -> h0 at each configured one-way delay; the first row is
    the same probe over the echo host's own loopback (no emulator), the probes' own cost."""
    h0, h1 = lab["h0"], lab["h1"]
    echo = h1.spawn(probe.command("udp-echo", "--port", str(ECHO_PORT)))
    echo.wait_for("ready")
    rows = []
    ping = probe.command("udp-ping", "127.0.0.1", str(ECHO_PORT), "--count", str(count))
    r = json.loads(h1.run([*ping, "--interval", "0.002"]).stdout)
    rows.append(
        {"path": "loopback, no emulator", "configured_rtt_ms": 0.0, **_summary(r["rtts_ms"])}
    )
    for delay_ms in delays_ms:
        lab.set_link("h0", "h1", LinkSpec(delay_s=delay_ms / 1000))
        n = count if delay_ms < 5 else max(50, count // 4)
        ping = probe.command("udp-ping", h1.address, str(ECHO_PORT), "--count", str(n))
        before = lab.counters()
        r = json.loads(h0.run([*ping, "--interval", "0.002"], timeout=120).stdout)
        after = lab.counters()
        delivered = after.delivered - before.delivered
        late_ms = (after.late_total_s - before.late_total_s) / max(1, delivered) * 1000
        rows.append(
            {
                "path": f"emulated, {delay_ms:g} ms one-way",
                "configured_rtt_ms": 2 * delay_ms,
                "lost": r["lost"],
                "emulator_mean_late_ms": late_ms,
                **_summary(r["rtts_ms"]),
            }
        )
    echo.stop()
    return rows


def measure_pps(lab: Lab, seconds: float) -> dict:
    """A UDP flood of 64-byte datagrams h0 -> h1 on an unlimited, zero-delay link."""
    h0, h1 = lab["h0"], lab["h1"]
    lab.set_link("h0", "h1", LinkSpec())
    before = lab.counters().links[("h0", "h1")]
    sink = h1.spawn(probe.command("udp-sink", "--port", str(SINK_PORT)))
    sink.wait_for("ready")
    flood = probe.command("udp-flood", h1.address, str(SINK_PORT), "--seconds", str(seconds))
    sent = json.loads(h0.run(flood, timeout=seconds + 30).stdout)
    got = sink.json_result()
    after = lab.counters().links[("h0", "h1")]
    forwarded = after.packets - before.packets
    return {
        "datagram_bytes": 64,
        "sent": sent["sent"],
        "sender_pps": sent["sent"] / sent["seconds"],
        "forwarded": forwarded,
        "forwarded_pps": forwarded / sent["seconds"],
        "received": got["received"],
    }


def measure_tcp(lab: Lab, rates_mbit: list[float | None], seconds: float) -> list[dict]:
    """One TCP flow h0 -> h1 for `seconds` through a link of each rate (None: unlimited),
    0.5 ms one-way delay each way."""
    h0, h1 = lab["h0"], lab["h1"]
    rows = []
    for rate in rates_mbit:
        spec = LinkSpec(delay_s=0.0005, rate_bps=rate * MBIT if rate else None)
        lab.set_link("h0", "h1", spec)
        before = lab.counters().links[("h0", "h1")]
        sink = h1.spawn(probe.command("tcp-sink", "--port", str(TCP_PORT)))
        sink.wait_for("ready")
        send = probe.command("tcp-send", h1.address, str(TCP_PORT), "--seconds", str(seconds))
        sent = json.loads(h0.run(send, timeout=seconds + 60).stdout)
        got = sink.json_result()
        after = lab.counters().links[("h0", "h1")]
        dropped = sum(after.dropped.values()) - sum(before.dropped.values())
        rows.append(
            {
                "configured_mbit": rate,
                "measured_mbit": got["bytes"] * 8 / got["seconds"] / MBIT,
                "intact": got["sha256"] == sent["sha256"],
                "packets": after.packets - before.packets,
                "dropped_packets": dropped,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("net-sim/reports/limits.json"))
    parser.add_argument("--quick", action="store_true", help="fewer pings, shorter floods")
    args = parser.parse_args(argv)
    check_requirements()
    count = 100 if args.quick else 400
    seconds = 1.0 if args.quick else 3.0
    hosts = ("h0", "h1")
    topo = Topology(
        hosts, dict.fromkeys(hosts), {("h0", "h1"): LinkSpec(), ("h1", "h0"): LinkSpec()}
    )
    started = time.time()
    with Lab(topo) as lab:
        rtt = measure_rtt(lab, [0.0, 0.5, 15.0], count)
        pps = measure_pps(lab, seconds)
        tcp = measure_tcp(lab, [1000, 100, None], seconds)
    result = {
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": sys.version},
        "when": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "rtt": rtt,
        "pps": pps,
        "tcp": tcp,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(
        f"{'round trip':<30} {'configured':>10} {'p50':>8} {'p99':>8} {'max':>8}"
        f" {'emulator late, mean':>20}  (ms)"
    )
    for r in rtt:
        late = r.get("emulator_mean_late_ms")
        print(
            f"{r['path']:<30} {r['configured_rtt_ms']:>10.2f} {r['p50_ms']:>8.3f} "
            f"{r['p99_ms']:>8.3f} {r['max_ms']:>8.3f} {'' if late is None else f'{late:.3f}':>20}"
        )
    print(
        f"\nUDP flood, 64-byte datagrams: sender {pps['sender_pps']:,.0f}/s, "
        f"emulator forwarded {pps['forwarded_pps']:,.0f}/s "
        f"({pps['forwarded']:,} in all, {pps['received']:,} received)"
    )
    print(f"\n{'TCP goodput, one flow':<30} {'configured':>10} {'measured':>10}  (Mbit/s)")
    for r in tcp:
        configured = f"{r['configured_mbit']:g}" if r["configured_mbit"] else "unlimited"
        print(f"{'':<30} {configured:>10} {r['measured_mbit']:>10.1f}  intact={r['intact']}")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
