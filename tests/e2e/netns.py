"""Network namespaces for multi-host tests on one machine (mDNS, relays, routes).

Every namespace, veth and address lives inside namespaces the lab creates (a private
10.23x.0.0/16 range); nothing is added to the host's own namespace, and everything is
removed at the end, even when the test fails. Needs root and `ip netns`.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

_ids = itertools.count()


def netns_available() -> str | None:
    """None if usable, else why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "network namespace tests need root"
    if shutil.which("ip") is None:
        return "network namespace tests need iproute2 (`ip`)"
    name = f"macheck{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def require_netns() -> None:
    why = netns_available()
    if why is not None:
        pytest.skip(why)


@dataclass
class NsProcess:
    ns: str
    proc: subprocess.Popen
    log_path: Path
    data_dir: Path | None = None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class Lab:
    """A set of namespaces; `close()` kills what was started in them and deletes them."""

    def __init__(self, root: Path) -> None:
        self.tag = f"ma{os.getpid() % 100000}x{next(_ids)}"
        self.root = root
        self.namespaces: list[str] = []
        self.procs: list[NsProcess] = []
        self._veth = itertools.count()

    # ----- topology -----

    def ns(self, name: str) -> str:
        full = f"{self.tag}{name}"
        _ip("netns", "add", full)
        self.namespaces.append(full)
        _ip("-n", full, "link", "set", "lo", "up")
        return full

    def bridge(self, name: str = "br") -> str:
        ns = self.ns(name)
        _ip("-n", ns, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
        _ip("-n", ns, "link", "set", "br0", "up")
        return ns

    def attach(self, ns: str, bridge: str, cidr: str) -> None:
        """Connect `ns` (as eth0, address `cidr`) to the bridge in namespace `bridge`."""
        port = f"p{next(self._veth)}"
        _ip("-n", bridge, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", bridge, "link", "set", port, "master", "br0", "up")
        self._up(ns, "eth0", cidr)
        _ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")

    def link(self, a: str, a_if: str, a_cidr: str, b: str, b_if: str, b_cidr: str) -> None:
        """A point-to-point veth between two namespaces."""
        _ip("-n", a, "link", "add", a_if, "type", "veth", "peer", "name", b_if, "netns", b)
        self._up(a, a_if, a_cidr)
        self._up(b, b_if, b_cidr)

    def _up(self, ns: str, ifname: str, cidr: str) -> None:
        _ip("-n", ns, "addr", "add", cidr, "dev", ifname)
        _ip("-n", ns, "link", "set", ifname, "up")

    def sysctl(self, ns: str, key: str, value: str) -> None:
        self.run(ns, "sysctl", "-q", "-w", f"{key}={value}")

    # ----- processes -----

    def run(self, ns: str, *cmd: str, timeout: float = 60, check: bool = True):
        return subprocess.run(
            ["ip", "netns", "exec", ns, *cmd],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
        )

    def spawn(self, ns: str, name: str, *cmd: str) -> NsProcess:
        log_path = self.root / f"{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, *cmd],
                stdout=log,
                stderr=log,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        p = NsProcess(ns, proc, log_path)
        self.procs.append(p)
        return p

    def meshagent(self, ns: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return self.run(ns, sys.executable, "-m", "meshagent", *args, timeout=timeout)

    def start_agent(self, ns: str, data_dir: Path, *args: str, timeout: float = 90) -> NsProcess:
        """`meshagent up` in `ns`, overlay on 0.0.0.0:9338, API on the namespace's loopback;
        returns once it logged agent.ready."""
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / "agent.json").unlink(missing_ok=True)
        p = self.spawn(
            ns,
            data_dir.name,
            sys.executable, "-m", "meshagent", "up",
            "--listen", "0.0.0.0:9338", "--api-host", "127.0.0.1", "--api-port", "0",
            "--threads", "1", "--slots", "1", "--ctx-size", "256",
            "--data-dir", str(data_dir), "--log-format", "json",
            *args,
        )  # fmt: skip
        p.data_dir = data_dir
        deadline = time.monotonic() + timeout
        while '"agent.ready"' not in p.log_text():
            if p.proc.poll() is not None:
                raise RuntimeError(f"agent in {ns} exited:\n{p.log_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"agent in {ns} did not start:\n{p.log_text()[-3000:]}")
            time.sleep(0.1)
        return p

    def peers(self, agent: NsProcess) -> dict:
        r = self.meshagent(agent.ns, "peers", "--json", "--data-dir", str(agent.data_dir))
        return json.loads(r.stdout)

    def status(self, agent: NsProcess) -> dict:
        r = self.meshagent(agent.ns, "status", "--json", "--data-dir", str(agent.data_dir))
        return json.loads(r.stdout)

    def peers_of_all(self, agents: list[NsProcess]) -> list[dict]:
        """`meshagent peers --json` in every agent's namespace, run in parallel."""
        procs = [
            subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    a.ns,
                    sys.executable,
                    "-m",
                    "meshagent",
                    "peers",
                    "--json",
                    "--data-dir",
                    str(a.data_dir),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for a in agents
        ]
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=60)
            if p.returncode != 0:
                raise RuntimeError(f"meshagent peers failed: {stderr}")
            out.append(json.loads(stdout))
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def wait_until(pred, timeout: float, what: str, interval: float = 0.2):
    """Poll `pred` until it returns a truthy value; returns (value, seconds taken)."""
    start = time.monotonic()
    last = None
    while time.monotonic() - start < timeout:
        last = pred()
        if last:
            return last, time.monotonic() - start
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout} s (last: {last!r})")
