"""Membership at scale: the SWIM state machines (`meshagent/gossip/swim.py`) of 10 to 1,000
members on the simulated bus (`meshagent/testing/swim_bus.py`, inter-city latencies of
`meshagent/testing/city_rtts.py`, virtual clock). Never asserts; prints a table and writes
JSON (default bench/results/swim.json).

For each size: members join one by one (10 ms apart, each through a random earlier member) and
the time until every view is full, then until every member has spread every join as often as
it does (`quiet_after_s`, and the bytes each sent per second until then); bytes each member
sends per second in a steady minute (the messages' encoded size, and with the overlay's
framing modelled); the time after one more member joins until its view is full and every view
lists it; the time after a member crashes until every other declares it dead (`--crashes`
members, one after another: the median and the longest); and, with 1% of messages lost, how
many members any view declared dead falsely over `--loss-minutes` virtual minutes, and how
many times a member had to refute a suspicion of itself.

    .venv/bin/python bench/swim.py [--sizes 10,100,300,1000] [--loss-minutes 10] [--crashes 5]
        [--signed] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import result_file

from meshagent.discovery.keep import KeepConfig
from meshagent.gossip.swim import SwimConfig
from meshagent.testing.swim_bus import FRAME_BYTES, SwimBus


def _wait(bus: SwimBus, done, limit: float, step: float = 0.05) -> float:
    start = bus.now
    while not done() and bus.now < start + limit:
        bus.run_until(bus.now + step)
    return round(bus.now - start, 2) if done() else float("inf")


def run(
    n: int,
    loss_minutes: float,
    seed: int,
    signed: bool = False,
    crashes: int = 5,
    bounded: bool = False,
) -> dict:
    """`signed`: members with identities, signed updates and the wire codec (`SwimBus`);
    `bounded`: members connected as agents are, on a bounded set each, probing those."""
    t0 = time.perf_counter()
    bus = SwimBus(seed=seed, signed=signed, keep=KeepConfig() if bounded else None)
    names = bus.grow(n)
    everyone = set(names)
    formed = _wait(bus, lambda: bus.views_complete(everyone), 300, 0.25)
    # Every join is spread retransmit x log2(N + 1) times by every member: the steady cost is
    # measured once that is done (and a few seconds more).
    quiet = _wait(bus, bus.quiet, 600, 1.0)
    formation = sum(m.bytes_sent for m in bus.members.values()) / n / bus.now
    bus.run_until(bus.now + 5)
    sent0 = {k: m.bytes_sent for k, m in bus.members.items()}
    wire0 = dict(bus.wire_bytes)
    window = 60.0
    bus.run_until(bus.now + window)
    sent = [bus.members[k].bytes_sent - sent0[k] for k in names]
    wire = [bus.wire_bytes[k] - wire0[k] for k in names]

    newcomer = bus.new_name()
    bus.add(newcomer, contact=names[bus.rng.randrange(n)])
    everyone.add(newcomer)
    joined = _wait(bus, lambda: bus.views_complete(everyone), 60)

    dead = []
    for i in range(min(crashes, n - 2)):
        victim = names[(n // 2 + i * 7919) % n]
        bus.crash(victim)
        dead.append(_wait(bus, lambda v=victim: bus.dead_everywhere(v), 60))
        bus.run_until(bus.now + 5)
    row = {
        "members": n,
        "signed": signed,
        "bounded": bounded,
        "formed_s": formed,
        "quiet_after_s": quiet,
        "formation_bytes_per_member_s": round(formation),
        "sent_bytes_per_member_s": round(sum(sent) / n / window),
        "sent_bytes_per_member_s_max": round(max(sent) / window),
        "wire_bytes_per_member_s": round(sum(wire) / n / window),
        "join_seen_everywhere_s": joined,
        "crash_dead_everywhere_s": max(dead),
        "crash_dead_median_s": statistics.median(dead),
        "crashes": len(dead),
    }
    # what is measured so far, before the long loss phase (a run stopped there keeps it)
    so_far = {**row, "so_far": True, "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(so_far), file=sys.stderr, flush=True)

    # 1% loss: false deaths are deaths of members that did not crash
    bus.loss = 0.01
    before = len(bus.deaths)
    incarnations = {k: m.incarnation for k, m in bus.members.items()}
    bus.run_until(bus.now + loss_minutes * 60)
    false = {m for _, _, m in bus.deaths[before:] if m not in bus.crashed}
    row["loss_minutes"] = loss_minutes
    row["false_deaths_at_1pct_loss"] = len(false)
    row["refutations_at_1pct_loss"] = sum(
        m.incarnation - incarnations[k] for k, m in bus.members.items() if k not in bus.crashed
    )
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10,100,300,1000")
    ap.add_argument("--loss-minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--bounded",
        action="store_true",
        help="members connected as agents are, to a bounded set each (discovery/keep.py)",
    )
    ap.add_argument("--crashes", type=int, default=5, help="members crashed one after another")
    ap.add_argument(
        "--signed", action="store_true", help="signed updates and records, through the codec"
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/swim.json"))
    args = ap.parse_args()
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        rows.append(run(n, args.loss_minutes, args.seed, args.signed, args.crashes, args.bounded))
        print(json.dumps(rows[-1]), file=sys.stderr)
    result_file.print_table(rows)
    result_file.write(
        args.out,
        {
            "config": asdict(SwimConfig()),
            "frame_bytes": FRAME_BYTES,
            "machine": result_file.machine(),
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
