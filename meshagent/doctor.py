"""`meshagent doctor`'s checks: each looks at one thing an agent needs (its data dir's files,
the API and overlay ports, mDNS, each relay, the llama.cpp build, memory against the model) and
says what it found and, for a problem, the one line that fixes it.

A check never changes anything. Where an agent runs for the data dir, the ports it holds are
its own, and what it reports (relays registered, mDNS sightings) is read from its status."""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from meshagent import capacity
from meshagent.config import API_KEY_ENV, JOIN_ENV, AgentConfig, DataDir
from meshagent.discovery import addresses
from meshagent.errors import MeshError
from meshagent.net.address import Address, is_loopback
from meshagent.wording import NOT_SERVED_SECTION, size

OK, WARN, FAIL = "ok", "warn", "fail"
RELAY_TIMEOUT = 3.0  # seconds to connect to a relay


@dataclass(frozen=True)
class Finding:
    level: str  # OK, WARN or FAIL
    check: str  # what was looked at: "ports", "relay", ...
    said: str  # what was found
    fix: str = ""  # one line that fixes it (WARN and FAIL)

    @property
    def more(self) -> str:
        """The section of docs/troubleshooting.md that explains a problem of this check."""
        section = TROUBLESHOOTING.get(self.check)
        return f'docs/troubleshooting.md, "{section}"' if section else ""


# Each check's problems, by the symptom the user sees (docs/troubleshooting.md's sections).
UNSEEN, SLOW, REFUSED = (
    "My machine doesn't see the others",
    "It is slow",
    "A client is refused",
)
UNSERVED = NOT_SERVED_SECTION
TROUBLESHOOTING = {
    "ports": UNSEEN,
    "mdns": UNSEEN,
    "relay": UNSEEN,
    "nat": UNSEEN,
    "memory": UNSERVED,
    "model": UNSERVED,
    "config": UNSERVED,
    "llama.cpp": SLOW,
    "windows": SLOW,
    "gpu": SLOW,
    "secrets": REFUSED,
    "data dir": REFUSED,
}


@dataclass(frozen=True)
class Situation:
    """What the checks look at: the data dir, its config, the running agent's status (None
    when no agent runs for the data dir) and its command line (None when unknown)."""

    data_dir: DataDir
    config: AgentConfig
    status: dict[str, Any] | None
    command: AgentCommand | None = None


@dataclass(frozen=True)
class AgentCommand:
    """The running agent's command line, as every user of the host can read it
    (`/proc/PID/cmdline`), and the directory relative paths in it start from."""

    pid: int
    argv: tuple[str, ...]
    cwd: Path

    def values(self, flag: str) -> list[str]:
        """The values given to `flag` (as `--flag VALUE` or `--flag=VALUE`)."""
        out = []
        for i, arg in enumerate(self.argv):
            if arg == flag and i + 1 < len(self.argv):
                out.append(self.argv[i + 1])
            elif arg.startswith(flag + "="):
                out.append(arg[len(flag) + 1 :])
        return out


def agent_command(dd: DataDir) -> AgentCommand | None:
    """The command line of the agent whose run file is in `dd`, where this host shows it
    (Linux's /proc); None when no agent runs or it cannot be read."""
    try:
        pid = int(json.loads(dd.run_path.read_text())["pid"])
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        cwd = dd.root
    argv = tuple(a.decode(errors="replace") for a in raw.split(b"\0") if a)
    return AgentCommand(pid, argv, cwd)


def running_status(dd: DataDir, headers: dict[str, str]) -> dict[str, Any] | None:
    """The status of the agent running for `dd`, or None when none answers."""
    try:
        url = json.loads(dd.run_path.read_text())["api"]
        r = httpx.get(f"{url}/control/status", headers=headers, timeout=3.0)
        r.raise_for_status()
        return r.json()
    except (OSError, ValueError, KeyError, httpx.HTTPError):
        return None


def check_files(s: Situation) -> list[Finding]:
    dd, out = s.data_dir, []
    if not dd.root.exists():
        return [Finding(OK, "data dir", f"{dd.root} does not exist yet; `meshagent up` makes it")]
    mode = stat.S_IMODE(dd.root.stat().st_mode)
    if mode & 0o022:
        out.append(
            Finding(
                WARN,
                "data dir",
                f"{dd.root} can be written by other users (mode {mode:o})",
                f"chmod 700 {dd.root}",
            )
        )
    for path, what in ((dd.identity_path, "identity key"), (dd.mesh_path, "mesh secret")):
        if not path.exists():
            continue
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            out.append(
                Finding(
                    FAIL,
                    "data dir",
                    f"the {what} {path} is readable by other users (mode {mode:o}): they "
                    "could pose as this agent or join the mesh",
                    f"chmod 600 {path}",
                )
            )
        else:
            out.append(Finding(OK, "data dir", f"the {what} {path} is private (mode {mode:o})"))
    return out


def check_secrets(s: Situation) -> list[Finding]:
    """Secrets other users of this host can read: an API key or invite token the running
    agent was given on its command line (the process list shows it), and a file holding
    API keys (config.toml with api_keys, an API key file) readable by group or others."""
    out = []
    exposed = {
        "--api-key": (
            "an API key",
            f"restart it with --api-key-file PATH (mode 600) or ${API_KEY_ENV} instead",
        ),
        "--join": (
            "the invite token, which carries the mesh secret,",
            "restart it without --join (the mesh is stored in mesh.key); to join, pass the "
            f"token as --join - (standard input), --join-file PATH or ${JOIN_ENV}",
        ),
    }
    c = s.command
    for flag, (what, fix) in exposed.items():
        if c is not None and any(v != "-" for v in c.values(flag)):
            out.append(
                Finding(
                    WARN,
                    "secrets",
                    f"the running agent (pid {c.pid}) was given {what} on its command line "
                    f"({flag}): every user of this host can read it in the process list",
                    fix,
                )
            )
    files: list[tuple[Path, str]] = []
    if s.config.api_keys:
        files.append((s.data_dir.config_path, "config.toml, which holds API keys,"))
    if s.config.api_key_file:
        files.append((Path(s.config.api_key_file).expanduser(), "the API key file"))
    if c is not None:
        files += [(c.cwd / p, "the API key file") for p in c.values("--api-key-file")]
        files += [(c.cwd / p, "the invite token file") for p in c.values("--join-file")]
    for path, what in dict(files).items():
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except OSError:
            continue
        if mode & 0o077:
            out.append(
                Finding(
                    WARN,
                    "secrets",
                    f"{what} {path} can be read by other users (mode {mode:o})",
                    f"chmod 600 {path}",
                )
            )
    if not out:
        out.append(Finding(OK, "secrets", "no key on the command line or in a file others read"))
    return out


def _bind_error(host: str, port: int) -> OSError | None:
    """Whether a TCP listener could bind host:port now (None: it could)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            return e
    return None


def check_ports(s: Situation) -> list[Finding]:
    c, out = s.config, []
    listen = Address.parse(c.listen)
    ports = (
        ("API", c.api_host, c.api_port, "api_port in config.toml, or --api-port"),
        ("overlay", listen.host or "0.0.0.0", listen.port, "listen in config.toml, or --listen"),
    )
    for what, host, port, setting in ports:
        where = f"{host}:{port}"
        if port == 0:
            out.append(Finding(OK, "ports", f"the {what} takes any free port on {host}"))
            continue
        if s.status is not None and _held_by_agent(s.status, what, port):
            out.append(Finding(OK, "ports", f"the {what} port {where} is this agent's"))
            continue
        error = _bind_error(host, port)
        if error is None:
            out.append(Finding(OK, "ports", f"the {what} port {where} is free"))
        elif error.errno == errno.EADDRINUSE:
            out.append(
                Finding(
                    FAIL,
                    "ports",
                    f"the {what} port {where} is in use by another program",
                    f"stop that program, or choose another port ({setting}; 0: any free one)",
                )
            )
        else:
            out.append(
                Finding(
                    FAIL,
                    "ports",
                    f"the {what} cannot listen on {where}: {error.strerror}",
                    f"use an address of this host ({setting})",
                )
            )
    return out


def _held_by_agent(status: dict[str, Any], what: str, port: int) -> bool:
    if what == "API":
        return str(status.get("api", "")).endswith(f":{port}")
    return any(str(a).endswith(f":{port}") for a in status.get("listen", []))


def check_mdns(s: Situation) -> list[Finding]:
    c = s.config
    if not c.mdns:
        return [Finding(OK, "mdns", "off (mdns = false): peers are found by invite or relay")]
    listen = Address.parse(c.listen)
    if listen.host and is_loopback(listen.host):
        return [Finding(OK, "mdns", "off: the overlay listens on loopback only")]
    interfaces = addresses.interface_ipv4s()
    if not interfaces:
        return [
            Finding(
                WARN,
                "mdns",
                "no network interface with an IPv4 address: no peer on the LAN can be found",
                "connect to a network, or join with an invite (`meshagent up --join TOKEN`)",
            )
        ]
    said = f"multicast on {', '.join(interfaces)}"
    if s.status is not None:
        seen = (s.status.get("mdns") or {}).get("seen") or []
        said += f"; the agent sees {len(seen)} other agent(s) on the LAN"
    return [Finding(OK, "mdns", said)]


def check_relays(s: Situation, connect: Callable[[str, int], None] | None = None) -> list[Finding]:
    """Each configured relay: reachable over TCP, and registered when an agent runs."""
    connect = connect or _tcp_connect
    registered = {
        r["address"]: r for r in (s.status or {}).get("relays", []) if isinstance(r, dict)
    }
    out = []
    for name in s.config.relays:
        try:
            address = Address.parse(name)
            connect(address.host, address.port)
        except (OSError, MeshError, ValueError) as e:
            out.append(
                Finding(
                    FAIL,
                    "relay",
                    f"the relay {name} cannot be reached: {_reason(e)}",
                    f"check the address, and that `meshagent relay` runs there with its port "
                    f"open; or remove {name} from relays in config.toml",
                )
            )
            continue
        r = registered.get(name)
        if r is not None and not r.get("registered"):
            out.append(
                Finding(
                    WARN,
                    "relay",
                    f"the relay {name} answers, but the agent is not registered there "
                    f"({r.get('error') or 'not yet'})",
                    "check that the relay serves this mesh's members (a relay of another "
                    "mesh refuses them)",
                )
            )
        else:
            out.append(Finding(OK, "relay", f"the relay {name} is reachable"))
    if not s.config.relays:
        out.append(Finding(OK, "relay", "none configured (only peers this host can dial)"))
    return out


def check_nat(s: Situation) -> list[Finding]:
    """What stands between the running agent and the internet, as its relays tell it, and
    what the user can change where peers elsewhere cannot dial it."""
    st = s.status
    if st is None or not st.get("relays"):
        return []
    reach = st.get("reachability") or {}
    kind, public = reach.get("nat", "unknown"), reach.get("public") or reach.get("public_hosts")
    seen = f" (public {', '.join(public)})" if public else ""
    if kind == "none":
        return [Finding(OK, "nat", "no NAT: peers elsewhere dial this agent's address directly")]
    if kind == "independent":
        return [
            Finding(
                OK,
                "nat",
                f"behind a cone NAT{seen}: peers behind another NAT reach this agent by a "
                "hole punched through both",
            )
        ]
    if kind == "dependent":
        listen = Address.parse(str((st.get("listen") or [s.config.listen])[0]))
        return [
            Finding(
                WARN,
                "nat",
                f"behind a symmetric NAT{seen}: it maps each peer to a new public port, so a "
                "peer behind another symmetric NAT reaches this agent only through the relay",
                f"forward TCP port {listen.port} on the router to this host and start with "
                "`--address PUBLIC_IP:PORT`, enable UPnP on the router, or run the agent on a "
                "host with a public address (`--listen 0.0.0.0:PORT`)",
            )
        ]
    return [Finding(OK, "nat", "not known yet: the relays have not said where they see us")]


def _tcp_connect(host: str, port: int) -> None:
    with socket.create_connection((host, port), timeout=RELAY_TIMEOUT):
        pass


def _reason(e: BaseException) -> str:
    if isinstance(e, TimeoutError | socket.timeout):
        return f"no answer within {RELAY_TIMEOUT:g} s"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e)


def check_build() -> list[Finding]:
    import llama_cpp

    from meshagent.engine.runtime import TILED_ENV, built_with_llamafile, tiled_kernels_on

    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    # "CPU : SSE3 = 1 | AVX = 1 | ...": a backend's name, then its features
    parts = [p.rsplit(":", 1)[-1] for p in info.split("|") if p.strip().endswith("= 1")]
    features = sorted(p.split("=")[0].strip() for p in parts)
    from meshagent import devices

    gpu = "a GPU backend" if llama_cpp.llama_supports_gpu_offload() else "CPU only"
    out = [
        Finding(
            OK,
            "llama.cpp",
            f"llama-cpp-python {llama_cpp.__version__}, {gpu} (devices: "
            f"{', '.join(devices.backends())}); CPU features: "
            f"{', '.join(features) or 'none reported'}",
        )
    ]
    gpus = devices.list_devices()
    for d in gpus:
        out.append(
            Finding(
                OK,
                "gpu",
                f"{d.name} ({d.description}, {d.kind}): {size(d.free_bytes)} free of "
                f"{size(d.total_bytes)}; layers are offloaded to it up to --max-vram",
            )
        )
    if not gpus:
        out.append(
            Finding(
                OK,
                "gpu",
                "none: this llama.cpp runs on the CPU. For a GPU, install a GPU build "
                "(docs/gpu.md)",
            )
        )
    if built_with_llamafile():
        out.append(
            Finding(
                WARN,
                "llama.cpp",
                "built with LLAMAFILE: draft windows are inexact, so speculation stays off "
                "and kept prefixes are not reused",
                'CMAKE_ARGS="-DGGML_LLAMAFILE=OFF" pip install --force-reinstall --no-cache-dir '
                "llama-cpp-python",
            )
        )
    if tiled_kernels_on():
        out.append(
            Finding(
                WARN,
                "llama.cpp",
                f"{TILED_ENV} is on: for K-quant and IQ models (Q4_K_M and the like) draft "
                "windows and prompt chunks are inexact, so speculation stays off and kept "
                "prefixes are not reused (prefill is faster)",
                f"unset {TILED_ENV}",
            )
        )
    return out


def check_memory(s: Situation, model_path: Path | None) -> list[Finding]:
    """Memory offered against what the model needs whole, with the agent's slots."""
    from meshagent.models.layout import inspect_model
    from meshagent.placement.planner import ModelCost

    c, gib = s.config, 1 << 30
    available = capacity.memory_available()
    offer = capacity.memory_offer(
        available,
        limit=c.max_memory,
        weights=int(c.mem_weights_gib * gib),
        kv=int(c.mem_kv_gib * gib),
    )
    if model_path is None:
        return [Finding(WARN, "memory", f"offers {size(offer.total)}; no model to weigh")]
    layout = inspect_model(model_path)
    cost = ModelCost.from_layout(model_path.stem, layout)
    # As placement counts it: compute buffers out of the memory beyond the offer first.
    spare = capacity.spare_memory(available, offer)
    need = cost.offer_bytes(0, layout.n_layers, c.slots * c.ctx_size, spare)
    said = (
        f"offers {size(offer.total)}; {model_path.stem} needs {size(need)} of it "
        f"whole ({c.slots} slots of {c.ctx_size} tokens)"
    )
    if offer.total * 0.9 >= need:  # the planner keeps a tenth free
        return [Finding(OK, "memory", said + ": it can serve it alone")]
    return [
        Finding(
            WARN,
            "memory",
            said + ": it serves only a part, with peers that offer the rest",
            "add agents to the mesh, or raise --max-memory, or lower --slots / --ctx-size",
        )
    ]


def check_windows(model_path: Path | None) -> list[Finding]:
    """Whether llama.cpp repacks the model's weights here ($MESHAGENT_REPACK), which makes a
    draft's window and a kept prefix inexact (decision 12): a warning, since it turns
    speculation and prefix reuse off."""
    from meshagent.engine.runtime import REPACK_ENV, inexact_model
    from meshagent.models.layout import inspect_model

    if model_path is None:
        return []
    why = inexact_model(inspect_model(model_path).weight_types)
    if not why:
        return []
    return [
        Finding(
            WARN,
            "windows",
            f"{why.split(';')[0]}: decode is faster, but on {model_path.stem} drafts "
            "(--speculation auto) and kept prefixes stay off",
            f"unset {REPACK_ENV}",
        )
    ]


def diagnose(s: Situation, model_path: Path | None, *, build: bool = True) -> list[Finding]:
    out = check_files(s) + check_secrets(s) + check_ports(s) + check_mdns(s) + check_relays(s)
    out += check_nat(s)
    if build:
        out += check_build() + check_windows(model_path)
    return out + check_memory(s, model_path)
