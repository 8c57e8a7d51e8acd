"""The scale simulation's run (`scale_sim.py`): the mesh forms, then churn for a number of
virtual minutes, one event a minute (a join, a crash of an agent serving a stage, a crash of
any agent, a cut of a tenth of the mesh and its heal), with requests throughout; each event's
time until every view took it in and until every model it touched is routable again; and the
report `bench/scale.py` prints."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any

from meshagent.testing.scale_sim import TICK_S, ScaleSim
from meshagent.testing.scale_tokens import prompt_of, reference


def run(
    n: int = 300,
    *,
    minutes: float = 30.0,
    partition_s: float = 45.0,
    load: float = 0.5,
    log: Callable[[dict], None] | None = None,
    **options: Any,
) -> dict:
    """The whole run: formation, then `minutes` of churn (one event a minute: a join, a
    crash of an agent serving a model, a crash of any agent, a partition of a random tenth
    of the mesh for `partition_s`, in turn), with requests throughout; its report.
    `options`: the simulation's (`ScaleSim`: seed, claims_by, quorum, ...)."""
    sim = ScaleSim(n, **options)
    sim.settle_coordinates()
    everyone = set(sim.names)
    # The agents start within n x 10 ms; placement begins once every view is full (planning
    # from hundreds of views that differ while the mesh forms is what an agent does, but
    # costs the simulation an assignment per distinct view).
    while not sim.bus.views_complete(everyone) and sim.bus.now < 300:
        sim.bus.run_until(sim.bus.now + TICK_S)
    sim.tally.views_full_s = round(sim.bus.now, 2)
    while not sim.all_routable() and sim.bus.now < 900:
        sim.step(None)
    sim.tally.formed_s = round(sim.bus.now, 2) if sim.all_routable() else math.inf
    sim.set_load(load)
    formation_bytes = sum(sim.bus.wire_bytes.values())
    formation_at = sim.bus.now
    start = sim.bus.now
    kinds = ("join", "crash a stage", "crash any", "partition")
    events: list[tuple[float, int, str]] = []
    for i in range(int(minutes)):
        heapq.heappush(events, (start + 30.0 + 60.0 * i, i, kinds[i % len(kinds)]))
    wire0 = dict(sim.bus.wire_bytes)
    end = start + minutes * 60.0
    heal_at = None
    open_events: list[dict] = []
    while sim.bus.now < end or any(r.finished is None and not r.failed for r in sim.requests):
        if sim.bus.now > end + 300:
            break
        if events and events[0][0] <= sim.bus.now:
            _, _, kind = heapq.heappop(events)
            open_events.append(_event(sim, kind, partition_s))
            if kind == "partition":
                heal_at = sim.bus.now + partition_s
        if heal_at is not None and sim.bus.now >= heal_at:
            sim.heal()
            heal_at = None
            open_events.append({"kind": "heal", "at": sim.bus.now, "models": sorted(sim.models)})
        sim.step(start if sim.bus.now < end else None)
        for e in list(open_events):
            if _event_progress(sim, e):
                open_events.remove(e)
                sim.tally.events.append(e)
                if log:
                    log(e)
    for e in open_events:
        sim.tally.events.append(e)
    span = sim.bus.now - start
    live = [k for k in sim.bus.members if k not in sim.bus.crashed]
    sent = [sim.bus.wire_bytes[k] - wire0.get(k, 0) for k in live]
    return _report(sim, formation_bytes / n / max(formation_at, 1e-9), sent, span)


def _event(sim: ScaleSim, kind: str, partition_s: float) -> dict:
    now = sim.bus.now
    running = sorted(sim.running())
    serving = sorted({p for f in sim.force[0].values() for p in f.plan.peers})
    if kind == "join":
        name = sim.join(sim.rng.choice(running))
        return {"kind": kind, "at": now, "agent": name, "models": []}
    if kind in ("crash a stage", "crash any"):
        victim = sim.rng.choice(serving if kind == "crash a stage" else running)
        hit = sorted(m for m, f in sim.force[0].items() if victim in f.plan.peers)
        sim.crash(victim)
        return {"kind": kind, "at": now, "agent": victim, "models": hit}
    away = set(sim.rng.sample(running, max(1, len(running) // 10)))
    hit = sorted(m for m, f in sim.force[0].items() if away & set(f.plan.peers))
    sim.partition(away)
    return {"kind": kind, "at": now, "away": away, "models": hit, "lasts_s": partition_s}


def _event_progress(sim: ScaleSim, e: dict) -> bool:
    """Notes when each view has taken the event in (`views_s`) and when every model it
    touched is routable again on the main side with no plan pending (`replan_s`); True once
    both are known."""
    now = sim.bus.now
    if "views_s" not in e:
        running = sim.running()
        if e["kind"] == "join":
            seen = all(e["agent"] in sim.view(k) for k in running)
        elif e["kind"] in ("crash a stage", "crash any"):
            seen = all(e["agent"] not in sim.view(k) for k in running)
        elif e["kind"] == "partition":
            seen = all(
                sim.view(k) <= e["away"] if k in e["away"] else not sim.view(k) & e["away"]
                for k in running
            )
        else:  # heal
            seen = all(sim.view(k) == set(running) for k in running)
        if seen:
            e["views_s"] = round(now - e["at"], 2)
    if (
        "replan_s" not in e
        and now - e["at"] >= TICK_S
        and all(sim.routable(m, 0) is not None for m in e["models"])
        and not any(m in sim.pending[0] for m in e["models"])
    ):
        e["replan_s"] = round(now - e["at"], 2)
    return "views_s" in e and "replan_s" in e


def _report(sim: ScaleSim, formation_bps: float, sent: list[int], span: float) -> dict:
    rs = sim.requests
    done = [r for r in rs if r.finished is not None]
    failed = [r for r in rs if r.failed]
    reasons: dict[str, int] = {}
    for r in failed:
        reasons[r.failed] = reasons.get(r.failed, 0) + 1
    replayed = [r for r in done if r.replays]
    t = sim.tally
    by_kind: dict[str, list[float]] = {}
    for e in t.events:
        if "replan_s" in e and e["models"]:
            by_kind.setdefault(e["kind"], []).append(e["replan_s"])
    return {
        "agents": len(sim.names),
        "models": sorted(sim.models),
        "views_full_s": t.views_full_s,
        "formed_s": t.formed_s,
        "formation_bytes_per_agent_s": round(formation_bps),
        # (the rate over the formation's span: a quicker formation of the same bytes reads
        # higher; the total per agent compares runs)
        "formation_bytes_per_agent": round(formation_bps * t.formed_s)
        if math.isfinite(t.formed_s)
        else None,
        "churn_bytes_per_agent_s": round(sum(sent) / max(len(sent), 1) / span),
        "churn_bytes_per_agent_s_max": round(max(sent) / span),
        "records_republished": t.republished,
        "record_bytes_median": sorted(t.record_bytes)[len(t.record_bytes) // 2]
        if t.record_bytes
        else 0,
        "replan_s_by_event": {
            k: {"events": len(v), "median": sorted(v)[len(v) // 2], "max": max(v)}
            for k, v in sorted(by_kind.items())
        },
        "events": [plain(e) for e in t.events],
        "proposals": t.proposals,
        "decisions_cut_off": t.cut_off,
        "views_planned": t.assignments,
        "assign_s_median": round(sorted(t.assign_s)[len(t.assign_s) // 2], 3),
        "assign_s_p90": round(sorted(t.assign_s)[len(t.assign_s) * 9 // 10], 3),
        "assign_s_max": round(max(t.assign_s), 3),
        "views_planned_in_another_order": t.order_checks,
        "plans_differing_by_order": t.disagreements,
        "requests": len(rs),
        "served": len(done),
        "replayed": len(replayed),
        "replay_wait_s_max": round(max((r.waited_s for r in replayed), default=0.0), 1),
        # every token decoded on the chains' fake splits, replays' prefills included; the
        # served requests whose text is exactly the whole model's (`scale_tokens.reference`)
        "tokens_computed": sim.fake.tokens,
        "served_as_the_whole_model": sum(
            1 for r in done if r.tokens == reference(prompt_of(r.rid, r.prompt), r.output)
        ),
        "replayed_as_the_whole_model": sum(
            1 for r in replayed if r.tokens == reference(prompt_of(r.rid, r.prompt), r.output)
        ),
        "failed": len(failed),
        "failures": reasons,
        # still queued (for a chain's slot) or decoding when the run stopped, 300 s after
        # its last minute: demand beyond what the chains in force serve
        "unfinished": len(rs) - len(done) - len(failed),
        "unfinished_queued": sum(1 for r in sim.queue if not r.failed),
        "stages": {m: len(sim.first_chain(m)) for m in sorted(sim.force[0])},
        # chains of each model at the end, and the most it had at once
        "chains": {m: len(sim.chains_of(m)) for m in sorted(sim.force[0])},
        "chains_most": dict(sorted(t.chains_most.items())),
        "request_every_s": {m: round(v, 1) for m, v in sorted(sim.request_every.items())},
        # seconds per token of each chain in force at the end, one sequence each
        "token_s": {
            m: [round(sim.chain_token_s(m, c, 1), 3) for c in sim.chains_of(m)]
            for m in sorted(sim.force[0])
        },
        "state_counts": _states(sim),
    }


def plain(e: dict) -> dict:
    out = {k: v for k, v in e.items() if k not in ("away", "agent")}
    if "agent" in e:
        out["agent"] = e["agent"][:8]
    if "away" in e:
        out["agents_away"] = len(e["away"])
    return out


def _states(sim: ScaleSim) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in sim.running():
        for s in sim.bus.members[k].members.values():
            out[s.state.name] = out.get(s.state.name, 0) + 1
    return out
