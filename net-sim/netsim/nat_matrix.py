"""The `nat` scenario: every pair of NAT kinds, many runs each, over an emulated network.

Hosts `h0..h{2P-1}` and a relay are linked as a regime says (default `wan`); each host's
namespace is a NAT router of the kind a run asks for (`Lab.behind_nat`,
`meshagent/testing/nat_rules.py`), with the machine behind it, or for kind `none` the host
itself. P pairs run at once. A run starts one peer on each side of a pair (`nat_peer.py`: the
agent's overlay, gossip, relay client and dialer with hole punching, without a model), both
registered with the relay, and times:

- *ready*: both peers know what their relay sees of them (their NAT kind, or none);
- *direct*: both see the other on a direct connection, or the run's cap passes (relayed).

Each run listens on ports of its own, so no mapping or hole left by an earlier run helps a
later one. Per pair: how many runs ended direct, within 10 s of ready, the time to direct
(median, worst), the punches the puncher needed, and for relayed runs, why.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshagent.testing.nat_rules import KINDS
from netsim.lab import Host, Lab, Proc
from netsim.regimes import RELAY, topology

GOAL_S = 10.0  # seconds from ready to direct, the bar
RELAY_PORT = 9339
FIRST_PORT = 21000


@dataclass
class Side:
    kind: str
    host: Host  # where the peer runs (behind the router, or the host itself for `none`)


def pairs(kinds: tuple[str, ...]) -> list[tuple[str, str]]:
    """Each unordered pair of kinds once (the puncher is whichever peer id is lower)."""
    return list(itertools.combinations_with_replacement(kinds, 2))


def matrix(
    run_dir: Path,
    *,
    runs: int = 20,
    kinds: tuple[str, ...] = KINDS,
    regime: str = "wan",
    parallel: int = 3,
    cap_s: float = 20.0,
    seed: int = 1,
) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    todo = [(a, b, i) for a, b in pairs(kinds) for i in range(runs)]
    topo = topology(regime, 2 * parallel, relay=True)
    results: dict[str, list[dict[str, Any]]] = {f"{a}/{b}": [] for a, b in pairs(kinds)}
    with Lab(topo, workdir=run_dir / "lab", seed=seed) as lab:
        relay = lab[RELAY]
        relay.spawn([sys.executable, "-m", "meshagent", "relay", "--listen",
                     f"0.0.0.0:{RELAY_PORT}", "--log-format", "json"])  # fmt: skip
        _wait(lambda: '"relay.started"' in relay.procs[-1].log_text(), 30, "the relay")
        inner = {h: lab.behind_nat(h, "port-restricted") for h in topo.hosts if h != RELAY}
        port = itertools.count(FIRST_PORT, 2)
        while todo:
            batch, todo = todo[:parallel], todo[parallel:]
            slots = []
            for slot, (a, b, i) in enumerate(batch):
                sides = []
                for kind, h in ((a, f"h{2 * slot}"), (b, f"h{2 * slot + 1}")):
                    lab.set_nat(h, kind)
                    sides.append(Side(kind, lab[h] if kind == "none" else inner[h]))
                slots.append((a, b, i, sides, next(port)))
            records = _run_batch(lab, relay.address, slots, run_dir, cap_s)
            for (a, b, _, _, _), rec in zip(slots, records, strict=True):
                results[f"{a}/{b}"].append(rec)
                _say(a, b, rec)
    summary = {pair: summarise(recs) for pair, recs in results.items()}
    out = {
        "scenario": "nat",
        "regime": regime,
        "runs_per_pair": runs,
        "cap_s": cap_s,
        "goal_s": GOAL_S,
        "pairs": summary,
        "runs": results,
    }
    (run_dir / "report.json").write_text(json.dumps(out, indent=1))
    (run_dir / "report.md").write_text(table(out))
    return out


def _run_batch(
    lab: Lab, relay: str, slots: list, run_dir: Path, cap_s: float
) -> list[dict[str, Any]]:
    secret = os.urandom(32).hex()
    procs: list[tuple[Proc, Path]] = []
    began = time.monotonic()
    for a, b, i, sides, port in slots:
        for n, side in enumerate(sides):
            status = run_dir / "status" / f"{a}-{b}-{i}-{n}.json"
            status.parent.mkdir(parents=True, exist_ok=True)
            status.unlink(missing_ok=True)
            proc = side.host.spawn(
                [sys.executable, "-m", "netsim.nat_peer", "--mesh", secret, "--listen",
                 f"0.0.0.0:{port + n}", "--relay", f"{relay}:{RELAY_PORT}",
                 "--status", str(status)],
                env={"PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
            )  # fmt: skip
            procs.append((proc, status))
    # Every peer of the batch was started at once; a pair's own clock starts when both of it
    # are ready, and it has `cap_s` from then.
    out: list[dict[str, Any] | None] = [None] * len(slots)
    ready: list[float | None] = [None] * len(slots)
    deadline = began + 30 + cap_s
    while time.monotonic() < deadline and any(o is None for o in out):
        now = time.monotonic()
        for k in range(len(slots)):
            if out[k] is not None:
                continue
            s0, s1 = (_read(procs[2 * k][1]), _read(procs[2 * k + 1][1]))
            if ready[k] is None and _ready(s0) and _ready(s1):
                ready[k] = now
            if ready[k] is None:
                continue
            direct = _direct(s0, s1)
            if direct or now - ready[k] >= cap_s:
                out[k] = _record(s0, s1, ready[k] - began, (now - ready[k]) if direct else None)
        time.sleep(0.1)
    for k in range(len(slots)):
        if out[k] is None:
            s0, s1 = (_read(procs[2 * k][1]), _read(procs[2 * k + 1][1]))
            out[k] = _record(s0, s1, None, None)
            out[k]["why"] = "not ready (a peer did not hear from the relay)"
    for proc, _ in procs:
        proc.signal(signal.SIGTERM)
    for proc, _ in procs:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:  # a peer that will not stop is killed
            proc.kill()
    return [o for o in out if o is not None]


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _ready(s: dict[str, Any] | None) -> bool:
    return s is not None and s["reachability"]["nat"] != "unknown"


def _link(s: dict[str, Any] | None, other: dict[str, Any] | None) -> dict[str, Any] | None:
    if s is None or other is None:
        return None
    return s["peers"].get(other["peer_id"])


def _direct(s0: dict[str, Any] | None, s1: dict[str, Any] | None) -> bool:
    a, b = _link(s0, s1), _link(s1, s0)
    return bool(a and b and a["path"] == b["path"] == "direct")


def _record(s0, s1, ready_s: float | None, direct_s: float | None) -> dict[str, Any]:
    a, b = _link(s0, s1), _link(s1, s0)
    # The side that punched (`punch.punches` picks it) is the one with attempts.
    puncher = max(
        (a or {}, b or {}), key=lambda x: (x.get("punches", 0), x.get("punch_error") is not None)
    )
    return {
        "ready_s": None if ready_s is None else round(ready_s, 2),
        "direct_s": None if direct_s is None else round(direct_s, 2),
        "path": "direct" if direct_s is not None else (a or {}).get("path"),
        "punches": puncher.get("punches", 0),
        "why": None if direct_s is not None else puncher.get("punch_error"),
        "nat": [None if s is None else s["reachability"]["nat"] for s in (s0, s1)],
        "rtt_ms": (a or {}).get("rtt_ms"),
    }


def summarise(recs: list[dict[str, Any]]) -> dict[str, Any]:
    direct = [r["direct_s"] for r in recs if r["direct_s"] is not None]
    within = [t for t in direct if t <= GOAL_S]
    whys = sorted({r["why"] for r in recs if r["direct_s"] is None and r["why"]})
    return {
        "runs": len(recs),
        "direct": len(direct),
        "within_goal": len(within),
        "share_within_goal": round(len(within) / len(recs), 3) if recs else 0.0,
        "direct_s_median": round(statistics.median(direct), 2) if direct else None,
        "direct_s_max": round(max(direct), 2) if direct else None,
        "punches_median": statistics.median([r["punches"] for r in recs]) if recs else 0,
        "relayed_why": whys[:3],
    }


def table(out: dict[str, Any]) -> str:
    lines = [
        f"# NAT matrix ({out['regime']}, {out['runs_per_pair']} runs a pair, cap "
        f"{out['cap_s']:g} s)",
        "",
        "| pair | direct | within 10 s | time to direct s (median, worst) | punches (median) "
        "| relayed: why |",
        "|---|---|---|---|---|---|",
    ]
    for pair, s in out["pairs"].items():
        t = "-" if s["direct_s_median"] is None else f"{s['direct_s_median']}, {s['direct_s_max']}"
        lines.append(
            f"| {pair} | {s['direct']}/{s['runs']} | {s['within_goal']}/{s['runs']} | {t} "
            f"| {s['punches_median']} | {'; '.join(s['relayed_why']) or '-'} |"
        )
    return "\n".join(lines) + "\n"


def _say(a: str, b: str, rec: dict[str, Any]) -> None:
    took = "relayed" if rec["direct_s"] is None else f"direct in {rec['direct_s']} s"
    print(f"{a:>18} / {b:<18} {took}  punches {rec['punches']}  {rec['why'] or ''}", flush=True)


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start within {timeout:g} s")
        time.sleep(0.1)
