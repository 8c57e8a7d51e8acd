"""The harness: hosts in network namespaces, joined by the link emulator.

    from netsim.lab import Lab
    from netsim.regimes import topology

    with Lab(topology("wan", 3)) as lab:
        h0, h1, h2 = lab.hosts
        server = h1.spawn([sys.executable, "-m", "http.server", "8000"])
        h0.run(["curl", f"http://{h1.address}:8000/"])
        lab.partition("h0", "h1", seconds=10)
        print(lab.counters().links[("h0", "h1")].bytes)

Each host is a namespace named `nsim<pid>x<lab><host>` with loopback up and one TUN device
(`nsim0`, address 10.77.0.<i+1>/24, multicast on, a route for 224.0.0.0/4) whose other end is
the emulator process. Processes run unmodified inside a host (`ip netns exec`).

Cleanup: on leaving the `with` block, normally or by an exception, and on SIGTERM or SIGINT
(which raise in the main thread and so leave the block), the lab stops every process it
started, kills anything else left in its namespaces, stops the emulator and deletes the
namespaces. If the harness itself is killed, the emulator sees its control channel close and
exits; the namespaces remain until `cleanup_stale()` (run by every new `Lab`) removes those
whose owning process is gone. Needs root.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshagent.testing.nat_rules import ruleset
from netsim import nsenter
from netsim.control import ControlClient
from netsim.errors import EmulatorError, NeedsRoot, NetSimError
from netsim.fabric import LinkCounters, host_address
from netsim.linkmodel import LinkSpec
from netsim.regimes import Topology

PREFIX = "nsim"
NETWORK = "10.77.0.0/24"
IFNAME = "nsim0"
NETNS_DIR = Path("/var/run/netns")
NET_SIM_DIR = Path(__file__).resolve().parent.parent

_STALE = re.compile(rf"^{PREFIX}(\d+)x\d+")
_HOST_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,15}$")
_lab_ids = itertools.count()


def check_requirements() -> None:
    """Raise `NeedsRoot` with what is missing, if anything."""
    if os.geteuid() != 0:
        raise NeedsRoot(
            "net-sim needs root: network namespaces and TUN devices can only be created by "
            "root; run it with sudo (or as root in a container with CAP_NET_ADMIN)"
        )
    if shutil.which("ip") is None:
        raise NeedsRoot("net-sim needs iproute2's `ip` command on PATH (apt install iproute2)")
    if not os.path.exists("/dev/net/tun"):
        raise NeedsRoot(
            "net-sim needs /dev/net/tun (load the tun module: modprobe tun; in a container, "
            "pass the device in, e.g. --device /dev/net/tun)"
        )


def requirements_missing() -> str | None:
    """None if a lab can run here, else why not (for skipping tests)."""
    try:
        check_requirements()
    except NeedsRoot as e:
        return str(e)
    return None


def _ip(*args: str, input: str | None = None) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, input=input)
    if r.returncode != 0:
        raise NetSimError(f"`ip {' '.join(args)}` failed: {(r.stderr or r.stdout).strip()}")


def _netns_names() -> list[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _netns_pids(netns: str) -> list[int]:
    r = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_all_in(netns: str) -> list[int]:
    pids = _netns_pids(netns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def _delete_netns(netns: str) -> None:
    _kill_all_in(netns)
    subprocess.run(["ip", "netns", "del", netns], capture_output=True)


def cleanup_stale() -> list[str]:
    """Delete namespaces left by labs whose process is gone (killed, crashed); returns them.
    Namespaces of labs still running, in this process or another, are left alone."""
    if shutil.which("ip") is None:
        return []
    removed = []
    for name in _netns_names():
        m = _STALE.match(name)
        if m is None:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        _delete_netns(name)
        removed.append(name)
    return removed


class Proc:
    """A process started in a host; its output goes to `log_path`."""

    def __init__(self, host: Host, argv: Sequence[str], popen: subprocess.Popen, log: Path):
        self.host = host
        self.argv = list(argv)
        self.popen = popen
        self.log_path = log

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout)

    def signal(self, sig: int) -> None:
        """Send `sig` to the process and its children (its process group)."""
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.popen.wait()

    def stop(self, timeout: float = 5.0) -> int:
        """SIGTERM, then SIGKILL if it has not exited within `timeout`; the exit status."""
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.popen.wait()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_for(self, text: str, timeout: float = 10.0) -> None:
        """Wait until `text` appears in the log; raise if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while text not in self.log_text():
            if not self.alive:
                raise NetSimError(f"{self.argv[0]} in {self.host.name} exited: {self._tail()}")
            if time.monotonic() > deadline:
                raise NetSimError(f"no {text!r} from {self.argv} within {timeout}s: {self._tail()}")
            time.sleep(0.02)

    def json_result(self, timeout: float = 30.0) -> dict[str, Any]:
        """Wait for the process to exit and parse the last line of its log as JSON."""
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise NetSimError(f"{self.argv} still running after {timeout}s") from None
        lines = self.log_text().strip().splitlines()
        try:
            return json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            raise NetSimError(f"no JSON result from {self.argv}: {self._tail()}") from None

    def _tail(self) -> str:
        return self.log_text()[-2000:]


class Host:
    """One emulated machine: a network namespace with one interface into the emulator."""

    def __init__(self, lab: Lab, name: str, netns: str, address: str) -> None:
        self.lab = lab
        self.name = name
        self.netns = netns
        self.address = address
        self.procs: list[Proc] = []
        self._n = itertools.count()

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address}, netns={self.netns!r})"

    @property
    def netns_path(self) -> str:
        return str(NETNS_DIR / self.netns)

    def connect(self, address: str, port: int, timeout: float = 10.0) -> socket.socket:
        """A TCP connection from inside this host (e.g. to an agent's API on 127.0.0.1),
        opened from the harness's own process."""
        return nsenter.connect_in(self.netns_path, address, port, timeout)

    def get_json(self, port: int, path: str, *, timeout: float = 10.0) -> Any:
        """GET `http://127.0.0.1:<port><path>` inside this host; the decoded JSON body.
        OSError if nothing answers, ValueError for a non-200 answer or a body not JSON."""
        return nsenter.get_json(self.netns_path, port, path, timeout=timeout)

    def _argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *map(str, argv)]

    def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        return {**os.environ, **(env or {})}

    def spawn(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        log_path: Path | str | None = None,
        cwd: Path | str | None = None,
    ) -> Proc:
        """Start `argv` in this host, in a session of its own; stdout and stderr go to
        `log_path` (default: `<workdir>/<host>-<n>.log`). `env` is added to the harness's
        environment."""
        log = Path(log_path) if log_path else self.lab.workdir / f"{self.name}-{next(self._n)}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                self._argv(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self._env(env),
                cwd=cwd,
                start_new_session=True,
            )
        proc = Proc(self, argv, popen, log)
        self.procs.append(proc)
        return proc

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
        check: bool = True,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` in this host to completion; its output is captured as text."""
        return subprocess.run(
            self._argv(argv),
            env=self._env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            input=input,
        )

    def kill(self) -> list[int]:
        """SIGKILL every process in this host, as a power cut would; the pids killed."""
        pids = _kill_all_in(self.netns)
        for proc in self.procs:
            if proc.alive:
                proc.kill()
        return pids

    def stop_all(self, timeout: float = 5.0) -> None:
        for proc in self.procs:
            if proc.alive:
                proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()


@dataclass(frozen=True)
class Counters:
    """What the emulator forwarded and dropped: per directed link `(src, dst)`, and per
    sending host for packets with no destination host (`unrouted`); and its own timing
    error, how late packets were written behind their due times."""

    links: dict[tuple[str, str], LinkCounters]
    unrouted: dict[str, LinkCounters]
    uptime_s: float
    queued: int
    read_errors: int
    write_errors: int
    delivered: int
    late_total_s: float  # summed over `delivered`: how far behind due time they were written
    max_late_s: float

    @classmethod
    def from_reply(cls, r: Mapping[str, Any]) -> Counters:
        links = {}
        for key, c in r["links"].items():
            src, dst = key.split(">")
            links[(src, dst)] = LinkCounters.from_dict(c)
        return cls(
            links=links,
            unrouted={h: LinkCounters.from_dict(c) for h, c in r["unrouted"].items()},
            uptime_s=r["uptime_s"],
            queued=r["queued"],
            read_errors=r["read_errors"],
            write_errors=r["write_errors"],
            delivered=r["delivered"],
            late_total_s=r["late_total_s"],
            max_late_s=r["max_late_s"],
        )


class Lab:
    """Hosts of `topology` in namespaces, joined by a running emulator; use as a context
    manager (or call `start()` and `close()`). `seed` fixes the links' random draws; `mtu`
    is the TUN's; `congestion_control` and `sysctls` are set in every host."""

    def __init__(
        self,
        topology: Topology,
        *,
        workdir: Path | str | None = None,
        seed: int = 0,
        network: str = NETWORK,
        mtu: int = 1500,
        congestion_control: str | None = None,
        sysctls: Mapping[str, str] | None = None,
    ) -> None:
        for name in topology.hosts:
            if not _HOST_NAME.match(name):
                raise ValueError(f"host name {name!r}: use 1-16 of a-z, 0-9, _ and -")
        self.topology = topology
        self.seed = seed
        self.network = network
        self.mtu = mtu
        # New devices copy `default`: keep IPv6 (router solicitations, MLD) off the TUN,
        # while loopback keeps ::1. A namespace starts with the machine's TCP congestion
        # control and may only switch to one the machine lists as allowed.
        self.sysctls = {"net.ipv6.conf.default.disable_ipv6": "1"}
        if congestion_control is not None:
            self.sysctls["net.ipv4.tcp_congestion_control"] = congestion_control
        self.sysctls.update(sysctls or {})
        self.tag = f"{PREFIX}{os.getpid()}x{next(_lab_ids)}"
        # Without a workdir, start() makes a temporary one (and close() removes it).
        self.workdir = Path(workdir) if workdir else Path(tempfile.gettempdir()) / "netsim-unset"
        self._workdir_given = workdir is not None
        self._made_workdir: Path | None = None
        self.hosts: list[Host] = []
        self._by_name: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._inner: dict[str, Host] = {}  # the hosts behind a NAT (`behind_nat`), by router
        self._emulator: subprocess.Popen | None = None
        self._control: ControlClient | None = None
        self._old_handlers: dict[int, Any] = {}
        self._closed = False

    # ----- lifecycle -----

    def __enter__(self) -> Lab:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # Logs outlive a failure; an interrupt (Ctrl-C, SIGTERM) is no failure.
        self.close(keep_workdir=exc_type is not None and issubclass(exc_type, Exception))

    def start(self) -> Lab:
        check_requirements()
        if self._workdir_given:
            self.workdir.mkdir(parents=True, exist_ok=True)
        else:
            self.workdir = self._made_workdir = Path(tempfile.mkdtemp(prefix="netsim-"))
        cleanup_stale()
        self._install_signal_handlers()
        atexit.register(self.close)
        try:
            self._create_namespaces()
            self._start_emulator()
            self._configure_interfaces()
        except BaseException:
            self.close(keep_workdir=True)
            raise
        return self

    def close(self, *, keep_workdir: bool = False) -> None:
        """Stop every process, the emulator, and delete the namespaces; remove the workdir
        if the lab made it, unless `keep_workdir` (the `with` block keeps it when it raised,
        for the logs). Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            for host in self.hosts:
                host.stop_all(timeout=3.0)
            for netns in self._namespaces:
                _kill_all_in(netns)
            self._stop_emulator()
        finally:
            for netns in self._namespaces:
                _delete_netns(netns)
            self._restore_signal_handlers()
            if self._made_workdir is not None and not keep_workdir:
                shutil.rmtree(self._made_workdir, ignore_errors=True)

    def _install_signal_handlers(self) -> None:
        """SIGTERM and SIGHUP raise SystemExit, SIGINT KeyboardInterrupt, so the `with`
        block unwinds and cleans up; once cleanup has begun they wait for it to finish.
        Handlers the program set itself are left alone."""
        if threading.current_thread() is not threading.main_thread():
            return

        def leave(signum: int, frame: object) -> None:
            if self._closed:
                return
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)

        for sig, default in (
            (signal.SIGTERM, signal.SIG_DFL),
            (signal.SIGHUP, signal.SIG_DFL),
            (signal.SIGINT, signal.default_int_handler),
        ):
            if signal.getsignal(sig) is default:
                self._old_handlers[sig] = signal.signal(sig, leave)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    def _create_namespaces(self) -> None:
        for i, name in enumerate(self.topology.hosts):
            netns = f"{self.tag}{name}"
            _ip("netns", "add", netns)
            self._namespaces.append(netns)
            address = str(host_address(_network(self.network), i))
            host = Host(self, name, netns, address)
            self.hosts.append(host)
            self._by_name[name] = host
            settings = [f"{k}={v}" for k, v in self.sysctls.items()]
            r = host.run(["sysctl", "-qw", *settings], timeout=10, check=False)
            if r.returncode != 0:
                hint = ""
                if "congestion_control" in r.stderr:
                    hint = (
                        "; a namespace may only use the algorithms listed in this machine's "
                        "net.ipv4.tcp_allowed_congestion_control"
                    )
                raise NetSimError(f"sysctl in {netns} failed: {r.stderr.strip()}{hint}")

    def _start_emulator(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {**os.environ, "PYTHONPATH": _pythonpath()}
        with open(self.workdir / "emulator.log", "ab") as log:
            self._emulator = subprocess.Popen(
                [sys.executable, "-m", "netsim.emulator", "--control-fd", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # a terminal's Ctrl-C reaches the harness, not it
            )
        theirs.close()
        self._control = ControlClient(ours)
        self._control.request(
            "start",
            topology=self.topology.to_dict(),
            network=self.network,
            seed=self.seed,
            ifname=IFNAME,
            netns={h.name: str(NETNS_DIR / h.netns) for h in self.hosts},
        )

    def _configure_interfaces(self) -> None:
        prefix = _network(self.network).prefixlen
        for host in self.hosts:
            commands = [
                "link set lo up",
                f"link set {IFNAME} mtu {self.mtu} multicast on",
                f"addr add {host.address}/{prefix} dev {IFNAME}",
                f"link set {IFNAME} up",
                f"route add 224.0.0.0/4 dev {IFNAME}",
            ]
            _ip("-n", host.netns, "-batch", "-", input="\n".join(commands) + "\n")

    def _stop_emulator(self) -> None:
        proc, control = self._emulator, self._control
        if control is not None:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(EmulatorError):
                    control.request("stop")
            control.close()
        if proc is not None:
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # ----- hosts and links -----

    def host(self, name: str) -> Host:
        try:
            return self._by_name[name]
        except KeyError:
            known = ", ".join(self._by_name)
            raise ValueError(f"no host named {name!r}; hosts: {known}") from None

    def __getitem__(self, name: str) -> Host:
        return self.host(name)

    def behind_nat(self, name: str, kind: str) -> Host:
        """Put a NAT of `kind` (`meshagent/testing/nat_rules.py`) between host `name` and the
        emulated internet: that host's namespace becomes the router (its emulator address is
        the public one) and a new namespace behind it, `192.168.<i>.2` on a veth from the
        router's `192.168.<i>.1`, is the machine to run processes on. Returns that inner host
        (named `<name>-in`); the lab deletes it with the rest."""
        router = self.host(name)
        i = self.hosts.index(router) + 1
        inner_ns = f"{router.netns}in"
        _ip("netns", "add", inner_ns)
        self._namespaces.append(inner_ns)
        inner = Host(self, f"{name}-in", inner_ns, f"192.168.{i}.2")
        _ip("-n", router.netns, "link", "add", "lan", "type", "veth", "peer", "name", "eth0",
            "netns", inner_ns)  # fmt: skip
        _ip("-n", router.netns, "-batch", "-", input=(
            f"addr add 192.168.{i}.1/24 dev lan\nlink set lan up\n"
        ))  # fmt: skip
        _ip("-n", inner_ns, "-batch", "-", input=(
            f"link set lo up\naddr add 192.168.{i}.2/24 dev eth0\nlink set eth0 up\n"
            f"route add default via 192.168.{i}.1\n"
        ))  # fmt: skip
        router.run(["sysctl", "-qw", "net.ipv4.ip_forward=1"], timeout=10)
        inner.run(["sysctl", "-qw", *(f"{k}={v}" for k, v in self.sysctls.items())], timeout=10)
        self._inner[name] = inner
        self.set_nat(name, kind)
        return inner

    def set_nat(self, name: str, kind: str) -> None:
        """Make the NAT in front of host `name` (`behind_nat`) one of `kind` from now on;
        `none`: no rules (the router forwards as it is, and the host itself is public)."""
        router, inner = self.host(name), self._inner[name]
        router.run(["nft", "delete", "table", "ip", "meshnat"], check=False, timeout=10)
        if kind != "none":
            rules = ruleset(kind, outside=IFNAME, inside="lan", host=inner.address)
            router.run(["nft", "-f", "-"], input=rules, timeout=10)

    @property
    def emulator_pid(self) -> int | None:
        return self._emulator.pid if self._emulator else None

    def _request(self, op: str, **args: Any) -> dict[str, Any]:
        if self._control is None or self._closed:
            raise EmulatorError("the lab is not running")
        if self._emulator is not None and self._emulator.poll() is not None:
            raise EmulatorError(
                f"the emulator exited with status {self._emulator.returncode}; "
                f"see {self.workdir / 'emulator.log'}"
            )
        return self._control.request(op, **args)

    def partition(self, a: str, b: str, seconds: float | None = None) -> None:
        """Cut both directions between `a` and `b`; the emulator heals them by itself after
        `seconds` if given. Packets already on the wire still arrive."""
        self._request("partition", a=a, b=b, seconds=seconds)

    def heal(self, a: str, b: str) -> None:
        self._request("heal", a=a, b=b)

    def set_link(self, a: str, b: str, spec: LinkSpec, *, both: bool = True) -> None:
        """Give the `a>b` direction (and `b>a` unless `both` is False) a new spec."""
        for src, dst in [(a, b), (b, a)] if both else [(a, b)]:
            self._request("set_link", src=src, dst=dst, spec=spec.to_dict())

    def spec(self, a: str, b: str) -> LinkSpec:
        return LinkSpec.from_dict(self._request("spec", src=a, dst=b)["spec"])

    def counters(self) -> Counters:
        return Counters.from_reply(self._request("counters"))


def _network(network: str) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network(network)


def _pythonpath() -> str:
    current = os.environ.get("PYTHONPATH")
    return f"{NET_SIM_DIR}{os.pathsep}{current}" if current else str(NET_SIM_DIR)
