"""The `nat` scenario's split: a 3-stage split behind NATs, moving from relayed paths to
direct ones mid-stream.

Three hosts, each behind a NAT (`Lab.behind_nat`; port-restricted by default), and a relay,
linked as a regime says (default `wan`). The internet drops everything between the hosts
from the start (`Lab.partition`; the relay stays reachable), so the agents meet on the relay
and serve the split over relayed paths. Then, one greedy streamed request at a time from the
entry's host (a long copy, drafts off: one token a trip, so that a token's time is the
ring's; agents that try direct every second, `upgrade_interval = 1.0`):

- *moving*: the request starts on relayed paths; a few seconds in the cut heals, the agents
  punch through, and the split's streams move to the direct connections
  (`serving/moving.py`);
- *direct*: the same request again, every hop direct;
- *cut*: the same request, direct; 2 s in the internet cuts the hosts apart again (as when a
  router forgets its mappings): the agents fall back to the relay, the chain breaks and the
  request replays there;
- *relayed*: the same request on the relay, every hop relayed; then the paths come back and
  the agents go direct again.

Per run: the time a token takes (the streamed chunks' span over their count). For *moving*:
that time before and after the switch (the last `stage.stream_moved` in the agents' logs),
the longest gap around it, how long after the heal the streams moved, whether its text is
the direct run's, and the chain's breaks while it ran (a break would replay the request).
Nothing here asserts: a failure is a figure in the report.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

from netsim.lab import Lab
from netsim.mesh import Agent, Mesh, Timeline
from netsim.regimes import topology
from netsim.scenarios import Driver

HOSTS = ("h0", "h1", "h2")
# Linux keeps a dropped SYN's mapping for 120 s, and every punch through the cut refreshes it
# (a punch reuses its ports): the first try after the heal would still find it and fail. A
# home router forgets sooner; 5 s keeps the run short.
SYN_SENT_S = 5
# Chunks this close to the switch belong to neither side of it.
AROUND_S = 0.5
# How far into the moving run the cut heals.
HEAL_AFTER_S = 2.0
# How often a relayed pair tries direct (and the first wait between punches, doubling after
# each failure): 1 s rather than the default 5, so that the first punch after the heal comes
# while one request still runs.
UPGRADE_S = 1.0


def run(
    run_dir: Path,
    *,
    regime: str = "wan",
    tokens: int = 400,
    seed: int = 1,
    kinds: tuple[str, str, str] = ("port-restricted",) * 3,
) -> dict[str, Any]:
    """The three runs; `kinds`: the NAT in front of each host (`none`: none)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    topo = topology(regime, len(HOSTS), relay=True)
    with Lab(topo, workdir=run_dir / "lab", seed=seed) as lab:
        inner = {}
        for h, kind in zip(HOSTS, kinds, strict=True):
            # Kind `none`: the host itself, on the internet.
            inner[h] = lab[h] if kind == "none" else lab.behind_nat(h, kind)
            key = "net.netfilter.nf_conntrack_tcp_timeout_syn_sent"
            lab[h].run(["sysctl", "-qw", f"{key}={SYN_SENT_S}"], timeout=10)
        for a, b in itertools.combinations(HOSTS, 2):
            lab.partition(a, b)
        tl = Timeline()
        mesh = Mesh(lab, run_dir, tl)
        mesh.start_relay()
        for h in HOSTS:
            args = ["--name", h, *mesh.agent_args, "--relay", mesh.relay_address]
            data = run_dir / "agents" / h
            data.mkdir(parents=True, exist_ok=True)
            (data / "config.toml").write_text(f"upgrade_interval = {UPGRADE_S}\n")
            mesh.agents[h] = Agent(h, inner[h], data, args)
        mesh.start_with_secret(HOSTS)
        plan = mesh.wait_routable(stages=3)
        entry = mesh.entry(plan)
        out: dict[str, Any] = {
            "scenario": "nat-split",
            "regime": regime,
            "kinds": dict(zip(HOSTS, kinds, strict=True)),
            "tokens": tokens,
            "stages": mesh.named_stages(plan),
            "paths_before": {h: mesh.paths(h) for h in HOSTS},
        }
        driver = Driver(mesh, run_dir / "load")
        ask = ("--mix", "copy", "--speculation", "off", "--requests", "1", "--concurrency", "1")
        ask += ("--first", "0", "--max-tokens", str(tokens), "--seed", str(seed))
        # First, while the agents have failed to punch only a few times (each failure puts
        # the next try further off, up to a minute): the stream starts relayed, and the cut
        # heals a few seconds in.
        proc, path = driver.start(inner[entry], "moving", *ask)
        time.sleep(HEAL_AFTER_S)
        healed = tl.mark("heal")
        for a, b in itertools.combinations(HOSTS, 2):
            lab.heal(a, b)
        moving = _one(driver.finish(proc, path, "moving", 600))
        out["paths_after"] = _wait_paths(mesh, "direct")
        direct = _one(driver.run(inner[entry], "direct", *ask, timeout=600))
        # Then the direct paths die mid-stream (as when a router forgets its mappings): the
        # agents fall back to the relay, the chain breaks and the request replays there.
        proc, path = driver.start(inner[entry], "cut", *ask)
        time.sleep(HEAL_AFTER_S)
        tl.mark("cut")
        for a, b in itertools.combinations(HOSTS, 2):
            lab.partition(a, b)
        cut = _one(driver.finish(proc, path, "cut", 600))
        out["paths_cut_again"] = _wait_paths(mesh, "relayed")
        mesh.wait_routable(stages=3)
        relayed = _one(driver.run(inner[entry], "relayed", *ask, timeout=600))
        # And the paths come back: direct again.
        healed_again = tl.mark("heal")
        for a, b in itertools.combinations(HOSTS, 2):
            lab.heal(a, b)
        # (The punches failed all through the cut, so the next may be a minute away.)
        back = out["paths_healed_again"] = _wait_paths(mesh, "direct", timeout=150)
        out["direct_again"] = all(p == "direct" for v in back.values() for p in v.values())
        out["direct_again_after_heal_s"] = round(tl.now() - healed_again, 1)
        events = mesh.log_events(levels=("info", "warning", "error"))

    def within(e: dict[str, Any], rec: dict[str, Any]) -> bool:
        t0 = rec.get("t0")
        end = t0 + (rec.get("t_end") or 0) if t0 is not None else None
        return e["t"] is not None and end is not None and t0 <= e["t"] <= end

    moved = [e for e in events if e["event"] == "stage.stream_moved" and within(e, moving)]
    during = [e for e in events if e["event"] == "pipeline.broken" and within(e, moving)]
    switch = max((e["t"] for e in moved), default=None)
    out["phases"] = {
        "relayed": _phase(relayed, direct),
        "moving": _phase(moving, direct, switch),
        "direct": _phase(direct, direct),
        "cut": _phase(cut, direct),
    }
    out["moved"] = [
        {"host": e["host"], "t": e["t"], "label": e["detail"].get("label")} for e in moved
    ]
    out["switch_after_heal_s"] = None if switch is None else round(switch - healed, 2)
    out["breaks_during_moving"] = [e["detail"].get("why") for e in during]
    (run_dir / "report.json").write_text(json.dumps(out, indent=1))
    (run_dir / "report.md").write_text(table(out))
    return out


def _one(records: list[dict[str, Any]]) -> dict[str, Any]:
    return records[0] if records else {"error": "no record"}


def _wait_paths(mesh: Mesh, want: str, timeout: float = 60.0) -> dict[str, dict[str, str]]:
    """Each agent's path to each other (as soon as all are `want`, or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        paths = {h: mesh.paths(h) for h in HOSTS}
        if all(p == want for v in paths.values() for p in v.values()):
            return paths
        if time.monotonic() > deadline:
            return paths
        time.sleep(0.5)


def _token_ms(chunks: list[float]) -> float | None:
    """Milliseconds a chunk (a token, or a few where a draft was verified), on average over
    the chunks' span: chunks that arrive together in one read count as what they are."""
    if len(chunks) < 2:
        return None
    return round((chunks[-1] - chunks[0]) / (len(chunks) - 1) * 1000, 1)


def _phase(
    rec: dict[str, Any], reference: dict[str, Any], switch: float | None = None
) -> dict[str, Any]:
    chunks = rec.get("chunks") or []
    out = {
        "complete": bool(rec.get("complete")),
        "error": rec.get("error"),
        "completion_tokens": rec.get("completion_tokens"),
        "same_text": bool(rec.get("text")) and rec.get("text") == reference.get("text"),
        "replays": rec.get("replays"),
        "token_ms": _token_ms(chunks),
    }
    if switch is not None and rec.get("t0") is not None:
        at = switch - rec["t0"]  # the switch, in the request's own seconds
        before = [t for t in chunks if t < at - AROUND_S]
        after = [t for t in chunks if t > at + AROUND_S]
        near = [t for t in chunks if at - 2 <= t <= at + 2]
        out |= {
            "switch_s": round(at, 2),
            "token_ms_before": _token_ms(before),
            "token_ms_after": _token_ms(after),
            "longest_gap_ms_near_switch": (
                round(max(b - a for a, b in itertools.pairwise(near)) * 1000, 1)
                if len(near) > 1
                else None
            ),
            "chunks_before": len(before),
            "chunks_after": len(after),
        }
    return out


def _replays(ph: dict[str, Any]) -> str:
    """A run's replays, as the receipt gave them: how many, and how long each took."""
    replays = ph.get("replays") or []
    if not replays:
        return "none"
    took = ", ".join(f"{r.get('ms')} ms" for r in replays)
    return f"{len(replays)} (the chain broke; replayed over the relay in {took})"


def by_pair(matrix: dict[str, Any], split: dict[str, Any]) -> str:
    """The matrix's pairs with the split's time a token on the path each pair ends on: the
    direct run's where it ends direct, the relayed run's where it stays relayed (a token's
    time follows the path, whatever NAT opened it)."""
    ph = split["phases"]
    direct, relayed = ph["direct"]["token_ms"], ph["relayed"]["token_ms"]
    lines = [
        "| pair | ends | within 10 s | 3-stage split ms a token on that path | relayed |",
        "|---|---|---|---|---|",
    ]
    for pair, s in matrix["pairs"].items():
        ends = "direct" if s["direct"] * 2 > s["runs"] else "relayed"
        on = direct if ends == "direct" else relayed
        lines.append(
            f"| {pair} | {ends} ({s['direct']}/{s['runs']}) | {s['within_goal']}/{s['runs']} "
            f"| {on} | {relayed} |"
        )
    return "\n".join(lines) + "\n"


def table(out: dict[str, Any]) -> str:
    p = out["phases"]
    m = p["moving"]
    lines = [
        f"# A 3-stage split behind NATs, relayed to direct mid-stream ({out['regime']}, "
        f"{out['tokens']} tokens; NATs {', '.join(out['kinds'].values())})",
        "",
        "| run | ms a token | complete | same text as direct | replays |",
        "|---|---|---|---|---|",
    ]
    runs = (("relayed", "relayed"), ("moving", "moving (whole)"), ("direct", "direct"))
    runs += (("cut", "cut mid-stream"),)
    for name, label in runs:
        ph = p[name]
        lines.append(
            f"| {label} | {ph['token_ms']} | {ph['complete']} | {ph['same_text']} "
            f"| {len(ph['replays'] or [])} |"
        )
    lines += [
        "",
        f"- moving: {m.get('token_ms_before')} ms a token before the switch "
        f"({m.get('chunks_before')} chunks), {m.get('token_ms_after')} ms after "
        f"({m.get('chunks_after')} chunks); longest gap within 2 s of it "
        f"{m.get('longest_gap_ms_near_switch')} ms",
        f"- streams moved {out['switch_after_heal_s']} s after the heal: "
        + ", ".join(f"{x['host']} {x['label']}" for x in out["moved"]),
        f"- chain breaks while it ran: {len(out['breaks_during_moving'])}",
        f"- cut mid-stream: replays {_replays(p['cut'])}; "
        + (
            f"direct again {out['direct_again_after_heal_s']} s after the paths came back"
            if out["direct_again"]
            else f"not all direct {out['direct_again_after_heal_s']} s after the paths came back"
        ),
        f"- stages: {out['stages']}",
    ]
    return "\n".join(lines) + "\n"
