"""The certification scenarios: split serving per regime (with a soak), faults, discovery.

Each scenario builds its labs, starts real agents, drives load from inside a host, and returns
a plain dict of everything measured; `netsim/report.py` writes it out as markdown, JSON and
plots. Nothing here asserts: a failure is a figure in the report.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from meshagent.advertisement import draft_model_bytes
from meshagent.config import parse_size
from meshagent.models.default import draft_model_path
from netsim import metrics, workload
from netsim.errors import NetSimError
from netsim.lab import Host, Lab
from netsim.mesh import API_PORT, SMALL_AGENT, Mesh, Timeline
from netsim.regimes import Topology, topology

HOSTS = ("h0", "h1", "h2")


@dataclass(frozen=True)
class SplitSettings:
    """How much load a split run puts through the mesh."""

    requests: int = 40  # the soak: a mix of short and long prompts, streamed and not
    concurrency: int = 2
    calibration: int = 5  # requests run one at a time to measure the floor (each kind)
    decode_tokens: int = 64  # completion length of the calibration requests
    speculation: int = 3  # requests of each of `mixes`, with drafts off and on (auto)
    mixes: tuple[str, ...] = ("copy", "prose")  # the speculation phase's workloads (and "code")
    forwarded: int = 2  # requests sent to each non-entry agent (carried to the entry)
    idle_s: float = 5.0  # a quiet window, for the background bytes on each link
    seed: int = 1
    wire_dtype: str = "auto"  # as agents run by default: f32 unless certified
    timeout_s: float = 90.0  # a request with no byte for this long has failed
    # The model split (a GGUF; "": the embedded SmolLM2) and the memory each agent offers
    # for it; a draft model each agent is given (`--draft-model`: its entry drafts with it),
    # whose own memory is added to that offer, so the split keeps its shape.
    model: str = ""
    max_memory: str = "80M"
    draft_model: str = ""


class Driver:
    """Runs the load driver in a host and reads its records back, timed on the run's clock."""

    def __init__(self, mesh: Mesh, out_dir: Path) -> None:
        self.mesh = mesh
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)

    def start(self, host: Host, name: str, *args: str) -> tuple[Any, Path]:
        out = self.out_dir / f"{name}.jsonl"
        out.unlink(missing_ok=True)
        proc = host.spawn(
            workload.command("--out", str(out), "--port", str(API_PORT), *args),
            log_path=self.out_dir / f"{name}.log",
        )
        self.mesh.timeline.mark("load.start", phase=name, host=host.name)
        return proc, out

    def finish(self, proc: Any, out: Path, phase: str, timeout: float) -> list[dict[str, Any]]:
        try:
            proc.wait(timeout)
        except Exception:
            proc.stop()
        self.mesh.timeline.mark("load.end", phase=phase)
        return self.records(out, phase)

    def records(self, out: Path, phase: str) -> list[dict[str, Any]]:
        recs = workload.read_records(out)
        for r in recs:
            r["t0"] = round(self.mesh.timeline.rel(r["t_send"]), 6)
            r["phase"] = phase
        return recs

    def run(self, host: Host, name: str, *args: str, timeout: float) -> list[dict[str, Any]]:
        proc, out = self.start(host, name, *args)
        return self.finish(proc, out, name, timeout)


@contextlib.contextmanager
def _lab(topo: Topology, root: Path, seed: int) -> Iterator[Lab]:
    """A lab whose logs stay in the run's folder; the agents' data dirs go when it closes:
    they hold stage artifacts (tens of MB of model per agent) and the mesh's keys."""
    try:
        with Lab(topo, workdir=root / "lab", seed=seed) as lab:
            yield lab
    finally:
        shutil.rmtree(root / "agents", ignore_errors=True)


def _machine(lab: Lab) -> dict[str, Any]:
    import os
    import platform

    cc = lab.hosts[0].run(["sysctl", "-n", "net.ipv4.tcp_congestion_control"], check=False)
    return {
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "congestion_control": cc.stdout.strip() or None,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def _links(lab: Lab) -> dict[str, Any]:
    return {metrics.link_key(a, b): spec.to_dict() for (a, b), spec in lab.topology.links.items()}


def _start_mesh(mesh: Mesh) -> dict[str, Any]:
    """Relay, then agents by invite; waits for membership and a routable 3-stage plan."""
    tl = mesh.timeline
    mesh.start_relay()
    mesh.start_by_invite(list(HOSTS))
    last_start = max(e["t"] for e in tl.events if e["what"] == "agent.start")
    membership = mesh.wait_membership()
    plan = mesh.wait_routable(stages=3)
    routable = tl.first("routable")
    assert routable is not None
    all_ready = max(e["t"] for e in tl.events if e["what"] == "agent.ready")
    return {
        "plan": plan,
        "times": {
            "first_agent_ready_s": tl.first("agent.ready"),
            "all_agents_ready_s": all_ready,
            "membership_after_all_ready_s": round(membership - all_ready, 3),
            "last_agent_started_s": last_start,
            "membership_s": membership,
            "routable_s": routable,
            "membership_after_last_start_s": round(membership - last_start, 3),
            "routable_after_last_start_s": round(routable - last_start, 3),
        },
    }


def _record_end(facts: dict[str, Any], tl: Timeline, mesh: Mesh, lab: Lab) -> None:
    """What every scenario keeps of a mesh when it ends, however it ends: the timeline, the
    agents' log events and the emulator's counters."""
    facts["timeline"] = tl.events
    facts["log_events"] = mesh.log_events()
    facts["emulator"] = metrics.counters_window(_zero(lab), lab.counters())


def _tally(out: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """A scenario's requests, their totals and its failures, into `out`."""
    out["requests"] = records
    out["totals"] = {
        "requests": len(records),
        "ok": sum(1 for r in records if r["ok"]),
        "failed": sum(1 for r in records if not r["ok"]),
    }
    out["failures"] = metrics.failures(records)


@dataclass
class Running:
    """A started 3-agent mesh in a lab, as `_running_mesh` yields it."""

    lab: Lab
    mesh: Mesh
    driver: Driver
    timeline: Timeline
    plan: dict[str, Any]


@contextlib.contextmanager
def _running_mesh(
    regime: str,
    root: Path,
    seed: int,
    wire_dtype: str,
    facts: dict[str, Any],
    agent_args: Sequence[str] | None = None,
) -> Iterator[Running]:
    """A lab of `regime` (3 hosts and a relay) with the mesh started by invite and its plan
    routable. Records the machine, the links and discovery times in `facts` on the way in,
    and the timeline, the agents' log events and the emulator's counters on the way out,
    however the scenario inside ends."""
    tl = Timeline()
    with _lab(topology(regime, 3, relay=True), root, seed) as lab:
        facts["machine"] = _machine(lab)
        facts["links"] = _links(lab)
        more = {} if agent_args is None else {"agent_args": agent_args}
        mesh = Mesh(lab, root, tl, wire_dtype=wire_dtype, **more)
        try:
            started = _start_mesh(mesh)
            facts["discovery"] = started["times"]
            yield Running(lab, mesh, Driver(mesh, root / "load"), tl, started["plan"])
        finally:
            _record_end(facts, tl, mesh, lab)


def _agent_args(s: SplitSettings) -> list[str]:
    """The agents' command line for a split run: `SMALL_AGENT` with the run's model, memory
    and draft model."""
    args = list(SMALL_AGENT)
    memory = parse_size(s.max_memory)
    if s.draft_model:
        ctx = int(args[args.index("--ctx-size") + 1]) * int(args[args.index("--slots") + 1])
        memory += draft_model_bytes(draft_model_path(s.draft_model), ctx)
        args += ["--draft-model", s.draft_model]
    args[args.index("--max-memory") + 1] = str(memory)
    if s.model:
        args += ["--model", s.model]
    return args


def _draft_costs(status: dict[str, Any]) -> dict[str, Any] | None:
    """What the entry measured of its windows and draft model (`/control/status`), for the
    ceiling its drafts' acceptance allows (`metrics.draft_ceiling`)."""
    for model in status.get("models") or ():
        spec = model.get("speculation") or {}
        draft = spec.get("draft_model")
        if draft is not None:
            return {
                "model": model["id"],
                "window_cost": spec.get("window_cost"),
                "draft_model": draft.get("name"),
                "draft_forward_ms": draft.get("forward_ms"),
                "draft_read_ahead": draft.get("read_ahead"),
                "draft_read_when_asked": draft.get("read_when_asked"),
                "draft_right": draft.get("right"),
            }
    return None


def split(regime: str, run_dir: Path, settings: SplitSettings) -> dict[str, Any]:
    """Three small agents and a relay in `regime` (joined by invite, as a user would), split
    SmolLM2 three ways; the floor is measured with requests one at a time, then a soak."""
    s = settings
    root = run_dir / regime
    out: dict[str, Any] = {"regime": regime, "settings": asdict(s)}
    with _running_mesh(regime, root, s.seed, s.wire_dtype, out, _agent_args(s)) as run:
        lab, mesh, driver, tl, plan = run.lab, run.mesh, run.driver, run.timeline, run.plan
        entry = mesh.entry(plan)
        hops = mesh.ring(plan)
        out["plan"] = {
            "entry": entry,
            "stages": mesh.named_stages(plan),
            "epoch": plan["epoch"],
            "wire_dtype": plan.get("wire_dtype"),
            "est_token_ms": plan.get("est_token_ms"),
        }
        out["ring"] = [h.to_dict() for h in hops]
        out["paths"] = {n: mesh.paths(n) for n in HOSTS}
        host = lab[entry]
        common = ["--seed", str(s.seed), "--timeout", str(s.timeout_s)]

        c0 = lab.counters()
        time.sleep(s.idle_s)
        c1 = lab.counters()
        idle = metrics.counters_window(c0, c1)
        tl.mark("idle.window", seconds=s.idle_s)

        warm = driver.run(
            host, "warmup", "--mix", "count", "--requests", "1", "--max-tokens", "8",
            "--concurrency", "1", *common, timeout=300,
        )  # fmt: skip
        prefill = driver.run(
            host, "prefill", "--mix", "count-whole", "--requests", str(s.calibration),
            "--max-tokens", "1", "--concurrency", "1", *common, timeout=600,
        )  # fmt: skip
        c2 = lab.counters()
        decode = driver.run(
            host, "decode", "--mix", "count", "--requests", str(s.calibration),
            "--max-tokens", str(s.decode_tokens), "--concurrency", "1",
            "--speculation", "off", *common, timeout=1200,
        )  # fmt: skip
        c3 = lab.counters()
        drafting: dict[str, list[dict[str, Any]]] = {}
        for mix in s.mixes if s.speculation else ():
            for mode in ("off", "auto"):
                drafting[f"{mix}-{mode}"] = driver.run(
                    host, f"spec-{mix}-{mode}", "--mix", mix, "--requests",
                    str(s.speculation), "--concurrency", "1", "--speculation", mode, *common,
                    timeout=1800,
                )  # fmt: skip
        c3b = lab.counters()
        costs = _draft_costs(mesh.status(entry)) if drafting else None
        soak = driver.run(
            host, "soak", "--mix", "soak", "--requests", str(s.requests),
            "--concurrency", str(s.concurrency), *common, timeout=max(600, 20 * s.requests),
        )  # fmt: skip
        c4 = lab.counters()
        forwarded: list[dict[str, Any]] = []
        for name in HOSTS:
            if name != entry and s.forwarded:
                forwarded += driver.run(
                    lab[name], f"forwarded-{name}", "--mix", "stream", "--requests",
                    str(s.forwarded), "--concurrency", "1", *common, timeout=600,
                )  # fmt: skip
        out["final_paths"] = {n: mesh.paths(n) for n in HOSTS}
    out["isolation"] = isolation(prefill, decode, hops, metrics.counters_window(c2, c3))
    out["speculation"] = metrics.speculation(drafting) if drafting else None
    if costs is not None and out["speculation"]:
        out["draft_costs"] = costs
        for m in out["speculation"].values():
            if m["model_p"] is None:  # no window of its went: judged by what it proposed
                m["model_p"] = metrics.unsent_p(costs.get("draft_right"))
                m["model_p_unsent"] = m["model_p"] is not None
            m["ceiling"] = metrics.draft_ceiling(
                m["model_p"], costs["window_cost"], costs["draft_forward_ms"]
            )
    soak_window = metrics.counters_window(c3b, c4)
    out["soak"] = metrics.summarise(soak)
    out["soak"]["wire"] = metrics.wire_per_token(
        soak_window,
        out["soak"]["completion_tokens"],
        idle,
        processed=out["soak"]["completion_tokens"] + out["soak"]["prompt_tokens"],
    )
    out["soak"]["wire_window"] = {k: v for k, v in soak_window.items() if k != "links"}
    out["idle"] = idle
    out["forwarded"] = metrics.summarise(forwarded) if forwarded else None
    records = warm + prefill + decode + [r for rs in drafting.values() for r in rs]
    records += soak + forwarded
    for r in records:
        r["regime"] = regime
    _tally(out, records)
    out["totals"] |= {
        "streams": sum(1 for r in records if r["stream"]),
        "streams_complete": sum(1 for r in records if r["stream"] and r["complete"]),
    }
    return out


@dataclass(frozen=True)
class PrefixSettings:
    """Conversations of two turns through a split (kept prefixes)."""

    conversations: int = 3
    max_tokens: int = 32
    seed: int = 1
    timeout_s: float = 300.0


# Room for a conversation of about 1,600 tokens in one slot, and still too little memory for
# fewer than three agents to hold the model; what the plan leaves free (the auto prefix budget,
# about 20 MB at the entry) keeps such a conversation's KV for every stage. With two slots
# the plan leaves the entry too little to keep one.
PREFIX_AGENT = ("--max-memory", "80M", "--slots", "1", "--ctx-size", "2048", "--threads", "1")


def prefix(regime: str, run_dir: Path, settings: PrefixSettings) -> dict[str, Any]:
    """Three agents split SmolLM2 in `regime`; conversations of about 1,500 tokens, each
    asked twice (the second turn adds the first answer and a question), one at a time at
    the entry: the second turn's time to first token against the cold first turn's."""
    s = settings
    root = run_dir / regime
    out: dict[str, Any] = {"regime": regime, "settings": asdict(s)}
    with _running_mesh(regime, root, s.seed, "auto", out, PREFIX_AGENT) as run:
        lab, mesh, driver, plan = run.lab, run.mesh, run.driver, run.plan
        entry = mesh.entry(plan)
        out["plan"] = {"entry": entry, "stages": mesh.named_stages(plan)}
        out["ring"] = [h.to_dict() for h in mesh.ring(plan)]
        host = lab[entry]
        common = ["--seed", str(s.seed), "--timeout", str(s.timeout_s)]
        warm = driver.run(
            host, "warmup", "--mix", "count", "--requests", "1", "--max-tokens", "8",
            "--concurrency", "1", *common, timeout=300,
        )  # fmt: skip
        turns = driver.run(
            host, "conversation", "--mix", "conversation", "--requests",
            str(2 * s.conversations), "--concurrency", "1", "--max-tokens", str(s.max_tokens),
            "--speculation", "off", *common, timeout=1200 * s.conversations,
        )  # fmt: skip
        [model] = mesh.status(entry)["models"]
        out["prefix_cache"] = model["prefix_cache"]
    out["prefix"] = metrics.prefix(turns)
    records = warm + turns
    for r in records:
        r["regime"] = regime
    _tally(out, records)
    return out


def _zero(lab: Lab) -> Any:
    """Counters of nothing, to window from the lab's start."""
    from netsim.lab import Counters

    return Counters({}, {}, 0.0, 0, 0, 0, 0, 0.0, 0.0)


def isolation(
    prefill: Sequence[dict[str, Any]],
    decode: Sequence[dict[str, Any]],
    hops: Sequence[Any],
    window: dict[str, Any],
) -> dict[str, Any]:
    """Per-token latency of requests run one at a time, against its floor, and where the
    time beyond the floor goes."""
    compute = metrics.decode_compute_ms(prefill, decode)
    ok = [r for r in decode if r["ok"]]
    gaps = [g for r in ok for g in metrics.gaps_ms(r)]
    result: dict[str, Any] = {
        "requests": len(decode),
        "ok": len(ok),
        "stage_compute_ms": compute,
        "per_token_ms": metrics.spread(gaps),
        "per_token_request_mean_ms": metrics.spread(
            t for r in ok if (t := metrics.per_token_ms(r)) is not None
        ),
        "ttft_ms": metrics.spread(t for r in ok if (t := metrics.ttft_ms(r)) is not None),
        "gaps_ms": [round(g, 3) for g in gaps],
        "window": {k: v for k, v in window.items() if k != "links"},
    }
    if compute is None or not gaps:
        return result
    floor = metrics.floor_ms(compute, [h.delay_ms for h in hops])
    result["floor"] = floor
    median = result["per_token_ms"]["median"]
    mean = result["per_token_request_mean_ms"]["median"] if ok else median
    result["median_vs_floor"] = metrics.against_floor(median, floor["floor_ms"])
    result["mean_vs_floor"] = metrics.against_floor(mean, floor["floor_ms"])
    tokens = sum(r["completion_tokens"] or 0 for r in ok) + sum(r["prompt_tokens"] or 0 for r in ok)
    result["breakdown"] = breakdown(median, floor, hops, window, tokens)
    slow = floor["floor_ms"] + 10
    result["stalls"] = {
        "threshold_ms": round(slow, 3),
        "gaps_over": sum(1 for g in gaps if g > slow),
        "worst_ms": round(max(gaps), 3),
        "loss_drops_in_window": sum(c["dropped"].get("loss", 0) for c in window["links"].values()),
    }
    return result


def breakdown(
    measured: float,
    floor: dict[str, float],
    hops: Sequence[Any],
    window: dict[str, Any],
    tokens: int,
) -> dict[str, Any]:
    """Split the median per-token time: compute and propagation (the floor), serialisation
    at each hop's rate (bytes per token measured on that link), the emulator's own lateness
    per delivered packet on each hop, and the rest (software hand-offs: framing, encryption,
    event loops and threads of the agents, the HTTP stream to the client; 2 shared cores)."""
    serial = 0.0
    for h in hops:
        link = window["links"].get(metrics.link_key(h.src, h.dst))
        if link and h.rate_bps and tokens:
            serial += link["bytes"] / tokens * 8 / h.rate_bps * 1000
    late = (window.get("late_mean_ms") or 0.0) * len(hops)
    rest = measured - floor["floor_ms"] - serial - late
    return {
        "compute_ms": floor["compute_ms"],
        "propagation_ms": floor["ring_ms"],
        "serialisation_ms": round(serial, 3),
        "emulator_late_ms": round(late, 3),
        "software_ms": round(rest, 3),
        "measured_ms": round(measured, 3),
    }


# ----- faults -----


@dataclass(frozen=True)
class FaultSettings:
    regime: str = "wan"
    seed: int = 1
    wire_dtype: str = "auto"  # as agents run by default: f32 unless certified
    concurrency: int = 2
    before_s: float = 6.0  # load running before each fault
    observe_s: float = 20.0  # watching after a kill before restarting (3 agents, no spare:
    # the outage and the restart must fit in the agents' 30 s replay deadline)
    partition_s: float = 10.0
    after_s: float = 12.0  # load running once service is back
    power_cut: bool = True
    timeout_s: float = 60.0
    fail_pause_s: float = 0.5  # a worker's pause after a failed request
    recover_s: float = 90.0  # the most a restarted mesh gets to be routable again


def _watch(
    mesh: Mesh, names: Sequence[str], seconds: float, until: Callable[[], bool] | None = None
) -> None:
    """Poll placement on `names` for `seconds` (or until `until()`), marking each change."""
    last: dict[str, Any] = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        mesh.check_crashes()
        for n in names:
            p = mesh.placement(n)
            view = p and (p["routable"], p["epoch"], p.get("error"), len(p["stages"]))
            if view != last.get(n, "unset"):
                last[n] = view
                if p is None:
                    mesh.timeline.mark("placement", host=n, answer=False)
                else:
                    mesh.timeline.mark(
                        "placement",
                        host=n,
                        routable=p["routable"],
                        epoch=p["epoch"],
                        stages=mesh.named_stages(p),
                        error=p.get("error"),
                    )
        if until is not None and until():
            return
        time.sleep(0.5)


FAULTS = ("kill", "partition", "power_cut")


def faults(run_dir: Path, settings: FaultSettings) -> dict[str, Any]:
    """Each fault in a mesh of its own, started from nothing, under load: the middle stage's
    host killed and restarted; the link between the entry and the middle stage partitioned;
    (optionally) the middle stage's host losing power and network at once, then restored.
    Measures what in-flight and new requests see, and when service resumes."""
    s = settings
    out: dict[str, Any] = {"regime": s.regime, "settings": asdict(s), "phases": {}}
    records: list[dict[str, Any]] = []
    for n, name in enumerate(FAULTS):
        if name == "power_cut" and not s.power_cut:
            continue
        phase = _fault_phase(name, run_dir / name, s, first=10_000 * n)
        records += phase.pop("records")
        out["phases"][name] = phase
    _tally(out, records)
    return out


def _fault_phase(name: str, root: Path, s: FaultSettings, first: int) -> dict[str, Any]:
    facts: dict[str, Any] = {"name": name}
    recs: list[dict[str, Any]] = []
    with _running_mesh(s.regime, root, s.seed, s.wire_dtype, facts) as run:
        lab, mesh, driver, tl, plan = run.lab, run.mesh, run.driver, run.timeline, run.plan
        entry = mesh.entry(plan)
        stages = [st[0] for st in mesh.named_stages(plan)]
        victim = stages[1]  # the middle stage: it neither owns requests nor answers them
        survivors = [n for n in HOSTS if n != victim]
        facts["plan"] = {"entry": entry, "stages": mesh.named_stages(plan), "victim": victim}
        stop = root / "load" / f"{name}.stop"
        proc, path = driver.start(
            lab[entry], name, "--mix", "stream", "--concurrency", str(s.concurrency),
            "--seed", str(s.seed), "--timeout", str(s.timeout_s), "--stop-file", str(stop),
            "--first", str(first), "--fail-pause", str(s.fail_pause_s),
        )  # fmt: skip
        time.sleep(s.before_s)
        if name == "kill":
            facts["fault"] = f"kill -9 of every process on {victim} (the middle stage)"
            facts["fault_t"] = mesh.kill(victim)
            _watch(mesh, survivors, s.observe_s)
            facts.update(_restart(mesh, victim, survivors, s))
        elif name == "partition":
            facts["fault"] = (
                f"link {entry} (entry) <-> {victim} (middle stage) cut both ways for "
                f"{s.partition_s:g} s"
            )
            lab.partition(entry, victim, seconds=s.partition_s)
            facts["fault_t"] = tl.mark("fault.partition", a=entry, b=victim, seconds=s.partition_s)
            _watch(mesh, list(HOSTS), s.partition_s)
            facts["healed_t"] = facts["resumed_t"] = tl.mark("fault.healed", a=entry, b=victim)
            _watch(mesh, list(HOSTS), s.after_s + s.observe_s)
        else:
            facts["fault"] = (
                f"every link of {victim} (the middle stage) cut, then its processes killed"
            )
            facts["fault_t"] = mesh.power_cut(victim)
            _watch(mesh, survivors, s.observe_s)
            mesh.restore_links(victim)
            facts.update(_restart(mesh, victim, survivors, s))
        stop.touch()
        recs = driver.finish(proc, path, name, timeout=s.timeout_s + 120)
    for r in recs:
        r["regime"] = s.regime
    facts["requests"] = metrics.summarise(recs)
    facts.update(metrics.around_fault(recs, facts["fault_t"], facts.get("resumed_t")))
    facts["records"] = recs
    return facts


def _restart(mesh: Mesh, victim: str, survivors: Sequence[str], s: FaultSettings) -> dict[str, Any]:
    """Start the agent again (same data dir, same command line) and time its way back. If
    the mesh does not come back (an agent crashed, or no routable plan in time), that is
    recorded, and the load keeps running for the same while, to show what clients get."""
    tl = mesh.timeline
    restart = tl.mark("fault.restart", host=victim)
    facts: dict[str, Any] = {"restart_t": restart, "resumed_t": restart}
    try:
        mesh.start_agent(victim)
        mesh.wait_ready([victim])
        ready = tl.last("agent.ready")
        membership = mesh.wait_membership(HOSTS, label="after restart")
        plan = mesh.wait_routable(HOSTS, stages=3, timeout=s.recover_s, label="after restart")
        routable = tl.last("routable")
        facts["restart"] = {
            "agent_ready_s": round(ready - restart, 3),
            "membership_s": round(membership - restart, 3),
            "routable_s": round(routable - restart, 3),
            "stages": mesh.named_stages(plan),
        }
    except NetSimError as e:
        facts["recovery_error"] = str(e)[:2000]
        tl.mark("recovery.failed", error=str(e)[:300])
    _watch(mesh, [*survivors, victim], s.after_s)
    return facts


# ----- churn -----


@dataclass(frozen=True)
class ChurnSettings:
    regime: str = "wan"
    seed: int = 1
    wire_dtype: str = "auto"
    agents: int = 4  # three hold the model: one is spare
    requests: int = 200
    concurrency: int = 2
    period_s: float = 15.0  # a fault every period, the kinds in turn
    kinds: tuple[str, ...] = ("kill", "sigint", "power_cut", "partition")
    down_s: float = 8.0  # a killed, stopped or cut host is back (restarted) after this
    partition_s: float = 8.0
    grace_s: float = 10.0  # the agents' --grace: a stopped one must exit within it
    timeout_s: float = 90.0  # a request with no byte for this long has failed


@dataclass
class _Pending:
    """Something the churn loop does later: restart a host, or watch one stop."""

    due: float
    host: str
    what: str  # "restart", "restore" (links, then restart) or "exit" (watch a SIGINT)
    fault: dict[str, Any]


def churn(run_dir: Path, settings: ChurnSettings) -> dict[str, Any]:
    """Four agents (three hold the model) under a long mixed load while, every `period_s`,
    a stage host other than the client's is killed, stopped with SIGINT, powered off, or cut
    from the entry, then brought back. Greedy outputs are checked against references made
    one at a time on the undisturbed mesh first."""
    s = settings
    root = run_dir / s.regime
    out: dict[str, Any] = {"regime": s.regime, "settings": asdict(s)}
    tl = Timeline()
    hosts = [f"h{i}" for i in range(s.agents)]
    refs: list[dict[str, Any]] = []
    recs: list[dict[str, Any]] = []
    faults: list[dict[str, Any]] = []
    with _lab(topology(s.regime, s.agents, relay=True), root, s.seed) as lab:
        out["machine"] = _machine(lab)
        out["links"] = _links(lab)
        mesh = Mesh(lab, root, tl, wire_dtype=s.wire_dtype)
        try:
            mesh.start_relay()
            mesh.start_by_invite(hosts)
            last_start = max(e["t"] for e in tl.events if e["what"] == "agent.start")
            mesh.wait_membership()
            plan = mesh.wait_routable()
            out["formation"] = {
                "membership_after_last_start_s": round(tl.last("membership") - last_start, 3),
                "routable_after_last_start_s": round(tl.last("routable") - last_start, 3),
                "stages": mesh.named_stages(plan),
            }
            client = mesh.entry(plan)
            out["client"] = client
            driver = Driver(mesh, root / "load")
            common = ("--mix", "churn", "--seed", str(s.seed), "--timeout", str(s.timeout_s))
            refs = driver.run(lab[client], "reference", *common, "--references", timeout=900)
            proc, path = driver.start(
                lab[client], "churn", *common, "--requests", str(s.requests),
                "--concurrency", str(s.concurrency), "--first", "1000",
            )  # fmt: skip
            faults = _churn_loop(mesh, client, proc, s)
            recs = driver.finish(proc, path, "churn", timeout=60)
        finally:
            _record_end(out, tl, mesh, lab)
            # When the entry's chain broke and when it was opened again (info events).
            out["entry_events"] = [
                e
                for e in mesh.log_events(levels=("info", "error"))
                if e["host"] == out.get("client")
                and e["event"] in ("pipeline.broken", "pipeline.reconnected")
            ]
    for r in (*refs, *recs):
        r["regime"] = s.regime
    out["references"] = refs
    _tally(out, recs)
    streamed = [r for r in recs if r["stream"]]
    out["totals"]["streams"] = len(streamed)
    out["totals"]["streams_complete"] = sum(1 for r in streamed if r["complete"])
    out["totals"]["replayed"] = sum(1 for r in recs if r.get("replays"))
    out["summary"] = metrics.summarise(recs)
    out["faults"] = metrics.churn_faults(recs, faults)
    out["by_kind"] = metrics.churn_by_kind(out["faults"])
    out["greedy"] = metrics.greedy_identity(recs, refs)
    return out


def _churn_loop(mesh: Mesh, client: str, load: Any, s: ChurnSettings) -> list[dict[str, Any]]:
    """Inject a fault every `period_s` while the load runs, and bring each victim back after
    `down_s`; at the end every host is running again. Returns the faults, each with its
    run time `t`, `kind` and `host`."""
    import random
    import signal

    rng = random.Random(s.seed)
    faults: list[dict[str, Any]] = []
    pending: list[_Pending] = []
    next_fault = time.monotonic() + s.period_s
    n = 0
    while load.alive:
        now = time.monotonic()
        for p in [p for p in pending if p.due <= now]:
            pending.remove(p)
            pending.extend(_churn_step(mesh, p, s))
        if now >= next_fault:
            kind = s.kinds[n % len(s.kinds)]
            n += 1
            next_fault += s.period_s
            busy = {p.host for p in pending}
            f, later = _churn_fault(mesh, client, kind, busy, rng, s)
            faults.append(f)
            if later is not None:
                pending.append(later)
            if kind == "sigint" and "host" in f:
                mesh.agents[f["host"]].proc.signal(signal.SIGINT)  # type: ignore[union-attr]
        mesh.check_crashes()
        time.sleep(0.2)
    while pending:  # the load is done: bring everyone back, as promised
        p = pending.pop(0)
        time.sleep(max(0.0, p.due - time.monotonic()))
        pending.extend(_churn_step(mesh, p, s))
    return faults


def _churn_fault(
    mesh: Mesh, client: str, kind: str, busy: set[str], rng: Any, s: ChurnSettings
) -> tuple[dict[str, Any], _Pending | None]:
    """One fault of `kind` on a stage host that is neither the client's agent nor the
    entry, nor still down from an earlier fault."""
    tl = mesh.timeline
    plan = mesh.placement(client)
    stages = [st[0] for st in mesh.named_stages(plan)] if plan and plan["routable"] else []
    entry = stages[0] if stages else client
    candidates = [h for h in stages if h not in (client, entry, *busy) and mesh.agents[h].running]
    if not candidates:
        t = tl.mark("fault.skipped", kind=kind, stages=stages, busy=sorted(busy))
        return {"t": t, "kind": kind, "skipped": True}, None
    victim = rng.choice(candidates)
    due = time.monotonic() + s.down_s
    if kind == "kill":
        t = mesh.kill(victim)
        return {"t": t, "kind": kind, "host": victim}, _Pending(due, victim, "restart", {})
    if kind == "power_cut":
        t = mesh.power_cut(victim)
        return {"t": t, "kind": kind, "host": victim}, _Pending(due, victim, "restore", {})
    if kind == "partition":
        mesh.lab.partition(entry, victim, seconds=s.partition_s)
        t = tl.mark("fault.partition", a=entry, b=victim, seconds=s.partition_s)
        return {"t": t, "kind": kind, "host": victim, "with": entry}, None
    mesh.agents[victim].down = True  # sigint: the caller sends it once this is recorded
    t = tl.mark("fault.sigint", host=victim)
    f = {"t": t, "kind": kind, "host": victim}
    return f, _Pending(time.monotonic(), victim, "exit", f)


def _churn_step(mesh: Mesh, p: _Pending, s: ChurnSettings) -> list[_Pending]:
    """Do what was pending; what is pending after it."""
    agent = mesh.agents[p.host]
    if p.what == "exit":  # a stopped agent: note when it exited, then restart it later
        assert agent.proc is not None
        if agent.proc.alive:
            waited = time.monotonic() - (p.fault["t"] + mesh.timeline.t0)
            if waited < s.grace_s + 5:
                return [_Pending(time.monotonic() + 0.1, p.host, "exit", p.fault)]
            agent.proc.kill()
            p.fault["exit"] = "killed: still running past the grace"
        else:
            p.fault["exit_code"] = agent.proc.returncode
            p.fault["exit_s"] = round(mesh.timeline.now() - p.fault["t"], 3)
        return [_Pending(time.monotonic() + s.down_s, p.host, "restart", {})]
    if p.what == "restore":
        mesh.restore_links(p.host)
    mesh.start_agent(p.host)
    return []


# ----- discovery -----


def discovery(run_dir: Path, *, seed: int = 1, serve: int = 3) -> dict[str, Any]:
    """mDNS alone on one LAN segment, and the relay alone between isolated hosts: times to
    full membership and to a routable plan, and a few requests through the result."""
    out: dict[str, Any] = {"parts": {}}
    requests: list[dict[str, Any]] = []
    for part, topo, extra, relay in (
        ("mdns", topology("lan", 3), (), False),
        ("relay", topology("wan", 3, relay=True, isolated=True), ("--no-mdns",), True),
    ):
        tl = Timeline()
        root = run_dir / part
        res: dict[str, Any] = {}
        with _lab(topo, root, seed) as lab:
            res["machine"] = _machine(lab)
            res["links"] = _links(lab)
            mesh = Mesh(lab, root, tl)
            try:
                if relay:
                    mesh.start_relay()
                    extra = (*extra, "--relay", mesh.relay_address)
                mesh.start_with_secret(list(HOSTS), *extra)
                last_start = max(e["t"] for e in tl.events if e["what"] == "agent.start")
                membership = mesh.wait_membership()
                paths = {n: mesh.paths(n) for n in HOSTS}
                plan = mesh.wait_routable(stages=3)
                routable = tl.first("routable")
                assert routable is not None
                all_ready = max(e["t"] for e in tl.events if e["what"] == "agent.ready")
                res["times"] = {
                    "last_agent_started_s": last_start,
                    "all_agents_ready_s": all_ready,
                    "membership_after_all_ready_s": round(membership - all_ready, 3),
                    "membership_s": membership,
                    "routable_s": routable,
                    "membership_after_last_start_s": round(membership - last_start, 3),
                    "routable_after_last_start_s": round(routable - last_start, 3),
                    "per_agent_membership_s": {
                        e["what"].split(".", 1)[1]: round(e["t"] - last_start, 3)
                        for e in tl.events
                        if e["what"].startswith("membership.")
                    },
                }
                res["paths"] = paths
                res["plan"] = {"stages": mesh.named_stages(plan), "entry": mesh.entry(plan)}
                res["ring"] = [h.to_dict() for h in mesh.ring(plan)]
                logs = {n: "\n".join(p.read_text() for p in mesh.agents[n].logs) for n in HOSTS}
                res["found_by"] = {
                    n: {
                        event: text.count(f'"{event}"')
                        for event in (
                            "mdns.found",
                            "agent.bootstrapped",
                            "relay.client_registered",
                            "relay.circuit_accepted",
                            "dialer.connected",
                        )
                    }
                    for n, text in logs.items()
                }
                if serve:
                    driver = Driver(mesh, root / "load")
                    recs = driver.run(
                        lab[mesh.entry(plan)], "serve", "--mix", "stream", "--requests",
                        str(serve), "--concurrency", "1", "--seed", str(seed), timeout=600,
                    )  # fmt: skip
                    for r in recs:
                        r["phase"] = f"{part}-serve"
                    requests += recs
                    res["serve"] = metrics.summarise(recs)
            finally:
                _record_end(res, tl, mesh, lab)
        out["parts"][part] = res
    _tally(out, requests)
    return out


# ----- runs: a scenario, its scope, and its report -----


def _describe_links(links: dict[str, Any]) -> str:
    seen: dict[str, list[str]] = {}
    for key, spec in links.items():
        rate = spec.get("rate_bps")
        text = (
            f"{spec['delay_s'] * 1000:g} ms one-way, jitter ±{spec.get('jitter_s', 0) * 1000:g} "
            f"ms, loss {spec.get('loss', 0) * 100:g} %, "
            + (f"{rate / 1e6:g} Mbit/s" if rate else "no rate limit")
        )
        seen.setdefault(text, []).append(key)
    return "; ".join(f"{text} ({len(keys)} directed links)" for text, keys in seen.items())


AGENTS_TESTED = (
    "3 agents (`meshagent up`: 80 MB offered each, 2 slots of 1024 tokens, 1 compute thread) "
    "and a relay, each in its own network namespace, started from empty data dirs"
)
MODEL_TESTED = "SmolLM2-135M-Instruct Q4_1 (the embedded default), split 3 ways by placement"
COMMON_NOT_TESTED = (
    "CUBIC or any congestion control other than the machine's default (a namespace may only "
    "pick one the host allows: reno or bbr here); BBR largely ignores random loss, so loss "
    "costs less here than with CUBIC",
    "NATs: hosts here have routable addresses (NAT traversal is the `nat` scenario's); "
    "'isolated' hosts (reachable only through "
    "the relay) are the discovery scenario's",
    "reordering, bursty or correlated loss, delay that changes during a run, asymmetric links",
    "machines of different speeds: every agent shares the same 2 cores, so one stage's compute "
    "slows the others' and the driver's",
    "larger models, contexts above 1024 tokens, more than 3 agents, more than 2 concurrent "
    "requests, GPUs, IPv6",
)


def _split_agents(s: SplitSettings) -> str:
    """`AGENTS_TESTED` with the memory the split's agents offered."""
    if s.max_memory == "80M":
        return AGENTS_TESTED
    return AGENTS_TESTED.replace("80 MB offered each", f"{s.max_memory} offered each")


def _split_model(s: SplitSettings) -> str:
    """The model split and, if given, the draft model every agent had."""
    model = Path(s.model).name if s.model else None
    said = MODEL_TESTED if model is None else f"{model}, split 3 ways by placement"
    if s.draft_model:
        said += f"; draft model {Path(s.draft_model).name if s.draft_model != 'auto' else 'auto'}"
    return said


def split_scope(results: dict[str, Any], s: SplitSettings, soak_name: str) -> dict[str, Any]:
    regimes = list(results)
    tested = [f"regime `{n}`: {_describe_links(r.get('links', {}))}" for n, r in results.items()]
    cc = {r.get("machine", {}).get("congestion_control") for r in results.values()}
    tested += [
        _split_agents(s) + "; the second and third joined with an invite from the first "
        "(naming its address and the relay), as a user would",
        f"{_split_model(s)}; activations between stages as {s.wire_dtype}",
        f"TCP congestion control in every host: {', '.join(sorted(map(str, cc)))} "
        "(the machine's default)",
        f"the floor: 1 warm-up, then {s.calibration} one-token and {s.calibration} "
        f"{s.decode_tokens}-token greedy requests, one at a time, at the entry agent's API",
        f"{soak_name}: {s.requests} requests, {s.concurrency} at a time, at the entry agent's "
        "API; prompts short (a question: ~37 prompt tokens, 16 completion tokens) and long (a "
        "story: ~147 prompt tokens, 128 completion tokens), "
        "half streamed, half whole, shuffled in blocks of 4; temperature 0.7 with a seed per "
        "request; a request with no byte for "
        f"{s.timeout_s:g} s counts as failed",
        f"{s.forwarded} streamed requests to each agent that is not the entry (the agent "
        "carries them to the entry over the overlay)",
    ]
    not_tested = [
        *(f"the `{r}` regime" for r in ("lan", "wan", "longhaul", "mixed") if r not in regimes),
        "faults (kill, partition, restart): the faults scenario (`just sim-faults`)",
        "discovery without an invite (mDNS alone, relay alone): `just sim-discovery`",
        *COMMON_NOT_TESTED,
    ]
    return {"tested": tested, "not_tested": not_tested}


def faults_scope(f: dict[str, Any], s: FaultSettings) -> dict[str, Any]:
    first = next(iter(f["phases"].values()), {})
    victim = "the middle stage's host"
    tested = [
        f"regime `{s.regime}`: {_describe_links(first.get('links', {}))}",
        AGENTS_TESTED + ", joined by invite; each fault in a mesh of its own, started from nothing",
        MODEL_TESTED,
        f"load: streamed requests (short and long prompts), {s.concurrency} at a time, at the "
        f"entry agent's API, running from {s.before_s:g} s before each fault until service is "
        f"back; a request with no byte for {s.timeout_s:g} s counts as failed",
        f"kill: every process on {victim} gets SIGKILL; its kernel "
        "still closes its TCP connections (peers see a reset), as when the agent crashes; "
        f"watched {s.observe_s:g} s, then the agent restarted with the same data dir and "
        "command line",
        "partition: the link between the entry and the middle stage dropped every packet both "
        f"ways for {s.partition_s:g} s (packets already on the wire still arrived), then healed",
    ]
    if s.power_cut:
        tested.append(
            f"power cut: every link of {victim} cut first, then its processes killed, so its "
            f"peers got no reset, only silence; watched {s.observe_s:g} s, links restored and "
            "the agent restarted"
        )
    not_tested = [
        "killing the entry agent or the last stage (the middle stage was the one killed)",
        "a fault during prefill of a long prompt specifically (faults land wherever the load is)",
        "a spare agent: with 3 agents a lost stage comes back only with its host, so requests "
        "in flight wait (replay) for the restart; the churn scenario has a spare",
        *COMMON_NOT_TESTED,
    ]
    return {"tested": tested, "not_tested": not_tested}


def discovery_scope(d: dict[str, Any]) -> dict[str, Any]:
    parts = d.get("parts", {})
    tested = [
        "mdns: 3 agents on one LAN segment (`lan` links: "
        f"{_describe_links(parts.get('mdns', {}).get('links', {}))}), sharing only the mesh "
        "secret in their data dirs: no invite, no --peer, no relay",
        "relay: 3 isolated hosts (no route between them; each reaches only the relay host, by "
        f"`wan` links: {_describe_links(parts.get('relay', {}).get('links', {}))}), sharing the "
        "mesh secret, each started with --relay and --no-mdns",
        "in each: time from the last agent's start to every agent seeing all 3 alive, and to "
        "a routable 3-stage plan; a few streamed requests through the result",
    ]
    not_tested = [
        "mDNS across routers or Wi-Fi (multicast here is delivered by the emulator within a "
        "segment, without loss)",
        "hole punching or upgrading a relayed path to a direct one (there is no direct route)",
        *COMMON_NOT_TESTED,
    ]
    return {"tested": tested, "not_tested": not_tested}


def churn_scope(c: dict[str, Any], s: ChurnSettings) -> dict[str, Any]:
    tested = [
        f"regime `{s.regime}`: {_describe_links(c.get('links', {}))}",
        f"{s.agents} agents (`meshagent up`: 80 MB offered each, 2 slots of 1024 tokens, 1 "
        "compute thread; three can hold the model, so one is spare) and a relay, each in its "
        "own network namespace, started from empty data dirs, joined by invite",
        "SmolLM2-135M-Instruct Q4_1 (the embedded default), split by placement",
        f"references: every greedy request of the mix once, one at a time, before any fault; "
        f"then {s.requests} requests, {s.concurrency} at a time, at the API of the agent that "
        "was the entry when the mesh formed: short (~37 prompt tokens, 16 completion tokens) "
        "and long (~147, 128) prompts, streamed and whole, greedy and at temperature 0.7 with "
        f"a seed per request, shuffled in blocks of 8; a request with no byte for "
        f"{s.timeout_s:g} s counts as failed",
        f"every {s.period_s:g} s a fault on a stage host that is neither the client's agent "
        "nor the entry, nor still down: "
        + "; ".join(
            {
                "kill": f"kill: SIGKILL to every process of the host, restarted {s.down_s:g} s "
                "later (same data dir and command line)",
                "sigint": "sigint: SIGINT to the agent (it leaves gracefully; its exit code and "
                f"time are recorded), restarted {s.down_s:g} s after it exited",
                "power_cut": "power cut: every link of the host cut, then its processes killed "
                f"(its peers get silence, no reset); links restored and the agent restarted "
                f"{s.down_s:g} s later",
                "partition": f"partition: the link between the entry and the host cut both ways "
                f"for {s.partition_s:g} s",
            }[k]
            for k in s.kinds
        ),
    ]
    not_tested = [
        "killing the entry or the client's own agent: clients connect to the entry here, and a "
        "client connected to a lost machine loses its stream (a request carried from another "
        "agent continues at the next entry: tests/e2e/test_replay.py)",
        "two faults at once (each victim is back before the next fault may pick it)",
        *(x.replace("more than 3 agents", "more than 4 agents") for x in COMMON_NOT_TESTED),
    ]
    return {"tested": tested, "not_tested": not_tested}
