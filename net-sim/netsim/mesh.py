"""Real agents in a lab: start a relay and `meshagent up` in hosts, watch them find each other
and agree on a placement, and time every step.

    with Lab(topology("wan", 3, relay=True), workdir=run / "lab") as lab:
        mesh = Mesh(lab, run / "mesh", Timeline())
        mesh.start_relay()
        mesh.start_by_invite(["h0", "h1", "h2"])
        mesh.wait_membership()
        plan = mesh.wait_routable(stages=3)

Every agent listens for peers on 0.0.0.0:9338 and serves its API on its own host's loopback,
127.0.0.1:9337 (each host has its own); the harness reads the API through sockets opened in
the host (`Host.get_json`). Each agent start gets a log file of its own under `<root>/logs`.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from netsim.errors import NetSimError
from netsim.lab import Host, Lab, Proc
from netsim.regimes import RELAY

API_PORT = 9337
OVERLAY_PORT = 9338
RELAY_PORT = 9339
# SmolLM2 with 2 slots of 1024 tokens needs ~145 MB (weights + KV): no agent offering 80 MB
# can hold it, nor can two; three can, so placement splits it three ways.
SMALL_AGENT = ("--max-memory", "80M", "--slots", "2", "--ctx-size", "1024", "--threads", "1")
POLL_S = 0.2
_ENV = {"PYTHONUNBUFFERED": "1"}


class Timeline:
    """Named moments of a run, in seconds since it began (the machine's monotonic clock,
    which every process here shares, so driver records and harness events line up)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self.events: list[dict[str, Any]] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def mark(self, what: str, **detail: Any) -> float:
        t = round(self.now(), 3)
        self.events.append({"t": t, "what": what, **detail})
        return t

    def rel(self, monotonic: float) -> float:
        return monotonic - self.t0

    def rel_wall(self, wall: float) -> float:
        return wall - self.wall0

    def first(self, what: str) -> float | None:
        return next((e["t"] for e in self.events if e["what"] == what), None)

    def last(self, what: str) -> float:
        return next(e["t"] for e in reversed(self.events) if e["what"] == what)


@dataclass
class Agent:
    """One agent's host, data dir and command line; `proc` is its current process."""

    name: str
    host: Host
    data_dir: Path
    args: list[str]
    proc: Proc | None = None
    peer_id: str = ""
    logs: list[Path] = field(default_factory=list)
    down: bool = False  # stopped on purpose (a fault), not crashed
    crashed: bool = False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.alive


@dataclass(frozen=True)
class Hop:
    """One leg of the ring a token travels: activations from stage to stage, then the
    sampled token from the last stage straight back to the entry."""

    src: str  # host names
    dst: str
    path: str  # "direct" or "relayed" (as the sender's link to the receiver says)
    delay_ms: float  # configured one-way delay along that path (via the relay if relayed)
    rate_bps: float | None  # the slowest link on the path

    def to_dict(self) -> dict[str, Any]:
        return {
            "src": self.src,
            "dst": self.dst,
            "path": self.path,
            "delay_ms": self.delay_ms,
            "rate_bps": self.rate_bps,
        }


class Mesh:
    """The relay and agents of one run in a lab."""

    def __init__(
        self,
        lab: Lab,
        root: Path,
        timeline: Timeline,
        *,
        agent_args: Sequence[str] = SMALL_AGENT,
        wire_dtype: str = "auto",
    ) -> None:
        self.lab = lab
        self.root = root
        self.timeline = timeline
        self.agent_args = [*agent_args, "--wire-dtype", wire_dtype]
        self.agents: dict[str, Agent] = {}
        self.relay: Proc | None = None
        (root / "logs").mkdir(parents=True, exist_ok=True)
        (root / "agents").mkdir(parents=True, exist_ok=True)

    # ----- starting -----

    @property
    def relay_address(self) -> str:
        return f"{self.lab[RELAY].address}:{RELAY_PORT}"

    def start_relay(self, timeout: float = 60.0) -> None:
        host = self.lab[RELAY]
        cmd = ["-m", "meshagent", "relay", "--listen", f"0.0.0.0:{RELAY_PORT}", "--log-format"]
        self.relay = host.spawn(
            [sys.executable, *cmd, "json"], env=_ENV, log_path=self.root / "logs" / "relay.log"
        )
        self.relay.wait_for('"relay.started"', timeout)
        self.timeline.mark("relay.started", host=RELAY)

    def start_agent(self, name: str, *extra: str) -> Agent:
        """Start `meshagent up` in host `name` with a fresh data dir (or restart it with the
        same data dir and command line, if it ran before)."""
        agent = self.agents.get(name)
        if agent is None:
            host = self.lab[name]
            data_dir = self.root / "agents" / name
            args = ["--name", name, *self.agent_args, *extra]
            agent = self.agents[name] = Agent(name, host, data_dir, args)
        agent.down = agent.crashed = False
        agent.data_dir.mkdir(parents=True, exist_ok=True)
        (agent.data_dir / "agent.json").unlink(missing_ok=True)
        log = self.root / "logs" / f"{name}-{len(agent.logs)}.log"
        agent.logs.append(log)
        agent.proc = agent.host.spawn(
            [
                sys.executable, "-m", "meshagent", "up",
                "--data-dir", str(agent.data_dir),
                "--listen", f"0.0.0.0:{OVERLAY_PORT}",
                "--api-host", "127.0.0.1", "--api-port", str(API_PORT),
                "--log-format", "json",
                *agent.args,
            ],
            env=_ENV,
            log_path=log,
        )  # fmt: skip
        self.timeline.mark("agent.start", host=name, start=len(agent.logs))
        return agent

    def wait_ready(self, names: Iterable[str], timeout: float = 180.0) -> None:
        """Wait until each agent logged agent.ready; note its peer id."""
        for name in names:
            agent = self.agents[name]
            assert agent.proc is not None
            agent.proc.wait_for('"agent.ready"', timeout)
            status = agent.host.get_json(API_PORT, "/control/status")
            agent.peer_id = status["peer_id"]
            self.timeline.mark("agent.ready", host=name, peer_id=agent.peer_id)

    def invite(self, name: str) -> str:
        """A join token from agent `name`, naming its address and the relay (if any)."""
        agent = self.agents[name]
        argv = [sys.executable, "-m", "meshagent", "invite", "--data-dir", str(agent.data_dir)]
        argv += ["--address", f"{agent.host.address}:{OVERLAY_PORT}"]
        if self.relay is not None:
            argv += ["--relay", self.relay_address]
        return agent.host.run(argv, timeout=60).stdout.strip()

    def start_by_invite(self, names: Sequence[str], *extra: str, timeout: float = 180.0) -> None:
        """The way a user starts a mesh from nothing: the first agent alone (registered with
        the relay, if any), an invite from it, then every other agent with `--join`."""
        first, rest = names[0], names[1:]
        relay = ["--relay", self.relay_address] if self.relay is not None else []
        self.start_agent(first, *relay, *extra)
        self.wait_ready([first], timeout)
        token = self.invite(first)
        self.timeline.mark("invite", host=first)
        for name in rest:
            self.start_agent(name, "--join", token, *extra)
        self.wait_ready(rest, timeout)

    def start_with_secret(self, names: Sequence[str], *extra: str, timeout: float = 180.0) -> None:
        """Start every agent at once, each holding the same mesh secret in its data dir and
        no address of any other: they must find each other (mDNS on a LAN, or the relay)."""
        from meshagent.identity.mesh import MeshSecret
        from meshagent.identity.mesh_file import save_mesh

        secret = MeshSecret(os.urandom(32))
        for name in names:
            save_mesh(self.root / "agents" / name / "mesh.key", secret)
        for name in names:
            self.start_agent(name, *extra)
        self.wait_ready(names, timeout)

    # ----- watching -----

    def running(self) -> list[Agent]:
        return [a for a in self.agents.values() if a.running]

    def check_crashes(self) -> list[str]:
        """Agents that exited without being told to, each marked `agent.crashed` once (with
        its exit status and the last line of its log: the exception, if it raised one)."""
        out = []
        for agent in self.agents.values():
            if agent.proc is None or agent.running or agent.down:
                continue
            out.append(agent.name)
            if not agent.crashed:
                agent.crashed = True
                lines = [x for x in agent.proc.log_text().splitlines() if x.strip()]
                self.timeline.mark(
                    "agent.crashed",
                    host=agent.name,
                    status=agent.proc.returncode,
                    last_line=(lines[-1].strip() if lines else "")[:300],
                )
        return out

    def _require_running(self, names: Iterable[str]) -> None:
        crashed = set(self.check_crashes()) & set(names)
        if crashed:
            raise NetSimError(f"agent(s) {', '.join(sorted(crashed))} exited (see the timeline)")

    def status(self, name: str) -> dict[str, Any]:
        return self.agents[name].host.get_json(API_PORT, "/control/status")

    def peers(self, name: str) -> dict[str, Any]:
        return self.agents[name].host.get_json(API_PORT, "/control/peers")

    def _try(self, fn, name: str) -> Any:
        try:
            return fn(name)
        except (OSError, ValueError):
            return None

    def views(self, names: Iterable[str]) -> dict[str, dict[str, Any] | None]:
        return {n: self._try(self.peers, n) for n in names}

    def wait_membership(
        self, names: Sequence[str] | None = None, *, timeout: float = 120.0, label: str = ""
    ) -> float:
        """Wait until every agent in `names` (default: those running) sees all of them alive;
        marks `membership.<host>` per agent and `membership` when all do. Returns the time."""
        names = list(names or [a.name for a in self.running()])
        want = {self.agents[n].peer_id for n in names}
        seen: set[str] = set()
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while True:
            self._require_running(names)
            for name, view in self.views(n for n in names if n not in seen).items():
                if view is None:
                    continue
                alive = {p["peer_id"] for p in view["peers"] if p["state"] == "alive"}
                last[name] = sorted(alive)
                if want <= alive:
                    seen.add(name)
                    paths = {
                        self.name_of(p["peer_id"]): p["path"]
                        for p in view["peers"]
                        if not p["self"] and p["peer_id"] in want
                    }
                    self.timeline.mark(f"membership.{name}", label=label, paths=paths)
            if seen >= set(names):
                return self.timeline.mark("membership", label=label, hosts=names)
            if time.monotonic() > deadline:
                raise NetSimError(
                    f"membership not reached within {timeout}s; alive peers per agent: {last}"
                )
            time.sleep(POLL_S)

    def placement(self, name: str) -> dict[str, Any] | None:
        status = self._try(self.status, name)
        if status is None:
            return None
        return next(iter(status["placement"].values()), None)

    def model_id(self, name: str) -> str:
        return next(iter(self.status(name)["placement"]))

    def wait_routable(
        self,
        names: Sequence[str] | None = None,
        *,
        stages: int | None = None,
        timeout: float = 300.0,
        label: str = "",
    ) -> dict[str, Any]:
        """Wait until every agent in `names` (default: those running) holds the same plan in
        force, routable (with `stages` stages, if given); marks `routable`; the plan."""
        names = list(names or [a.name for a in self.running()])
        deadline = time.monotonic() + timeout
        while True:
            self._require_running(names)
            plans = {n: self.placement(n) for n in names}
            ok = all(
                p is not None
                and p["routable"]
                and (stages is None or len(p["stages"]) == stages)
                and p["epoch"] == plans[names[0]]["epoch"]  # type: ignore[index]
                for p in plans.values()
            )
            if ok:
                plan = plans[names[0]]
                assert plan is not None
                self.timeline.mark(
                    "routable", label=label, stages=self.named_stages(plan), epoch=plan["epoch"]
                )
                return plan
            if time.monotonic() > deadline:
                raise NetSimError(f"no routable plan within {timeout}s: {plans}")
            time.sleep(POLL_S)

    # ----- the plan on the network -----

    def name_of(self, peer_id: str) -> str:
        for agent in self.agents.values():
            if agent.peer_id == peer_id:
                return agent.name
        return peer_id[:12]

    def named_stages(self, plan: dict[str, Any]) -> list[list[Any]]:
        return [[self.name_of(p), a, b] for p, a, b in plan["stages"]]

    def entry(self, plan: dict[str, Any]) -> str:
        """The host that owns requests: the first stage of a split, or the whole replica."""
        if plan["stages"]:
            return self.name_of(plan["stages"][0][0])
        return self.name_of(plan["replicas"][0])

    def paths(self, name: str) -> dict[str, str]:
        """How agent `name` reaches each peer ("direct" or "relayed"), by host name."""
        view = self.peers(name)
        return {self.name_of(p["peer_id"]): p["path"] for p in view["peers"] if not p["self"]}

    def ring(self, plan: dict[str, Any]) -> list[Hop]:
        """The legs of one token's trip: stage to stage, then the last stage to the entry."""
        order = [s[0] for s in self.named_stages(plan)]
        legs = [*itertools.pairwise(order), (order[-1], order[0])]
        hops = []
        for src, dst in legs:
            path = self.paths(src).get(dst, "direct")
            via = [(src, RELAY), (RELAY, dst)] if path == "relayed" else [(src, dst)]
            specs = [self.lab.spec(a, b) for a, b in via]
            rates = [s.rate_bps for s in specs if s.rate_bps]
            hops.append(
                Hop(
                    src,
                    dst,
                    path,
                    round(sum(s.delay_s for s in specs) * 1000, 3),
                    min(rates) if rates else None,
                )
            )
        return hops

    # ----- faults -----

    def kill(self, name: str) -> float:
        """SIGKILL every process in the host (the agent crashes; its host's kernel still
        closes its connections). Returns the timeline's time of the kill."""
        self.agents[name].down = True
        self.agents[name].host.kill()
        return self.timeline.mark("fault.kill", host=name)

    def power_cut(self, name: str) -> float:
        """Cut every link of the host, then kill what runs in it: its peers get no FIN nor
        RST, only silence, as when a machine loses power or its network."""
        for other in self.lab.topology.hosts:
            if other != name and self.lab.topology.link(name, other) is not None:
                self.lab.partition(name, other)
        self.agents[name].down = True
        self.agents[name].host.kill()
        return self.timeline.mark("fault.power_cut", host=name)

    def restore_links(self, name: str) -> None:
        for other in self.lab.topology.hosts:
            if other != name and self.lab.topology.link(name, other) is not None:
                self.lab.heal(name, other)
        self.timeline.mark("fault.links_restored", host=name)

    # ----- logs -----

    def log_files(self) -> list[tuple[str, Path]]:
        files = [(a.name, p) for a in self.agents.values() for p in a.logs]
        if self.relay is not None:
            files.append((RELAY, self.relay.log_path))
        return files

    def log_events(self, levels: Iterable[str] = ("warning", "error", "critical")) -> list[dict]:
        """Warnings and errors from every agent's and the relay's JSON log, with the time
        in the run; a traceback (lines that are not JSON) is one event of level `crash`,
        named by its last line."""
        want = set(levels)
        out: list[dict[str, Any]] = []
        for name, path in self.log_files():
            if not path.exists():
                continue
            block: list[str] = []
            last_t: float | None = None
            for line in [*path.read_text(errors="replace").splitlines(), "{}"]:
                try:
                    rec = json.loads(line)
                except ValueError:
                    block.append(line)
                    continue
                if block:
                    text = "\n".join(block)
                    if "Traceback" in text or "Error" in text:
                        last = next((x.strip() for x in reversed(block) if x.strip()), "")
                        out.append(
                            {
                                "host": name,
                                "t": last_t,
                                "level": "crash",
                                "event": last.lstrip("| ")[:200],
                                "detail": text[-4000:],
                            }
                        )
                    block = []
                if not isinstance(rec, dict) or not rec:
                    continue
                t = None
                if "timestamp" in rec:
                    wall = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00"))
                    t = last_t = round(self.timeline.rel_wall(wall.timestamp()), 3)
                if rec.get("level") not in want:
                    continue
                detail = {k: v for k, v in rec.items() if k not in ("event", "level", "timestamp")}
                out.append(
                    {
                        "host": name,
                        "t": t,
                        "level": rec["level"],
                        "event": rec.get("event", ""),
                        "detail": detail,
                    }
                )
        return out
