"""The agent's data dir and its config file, created once on first start."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import platformdirs

from meshagent.errors import ConfigError
from meshagent.gossip.config import GossipConfig
from meshagent.identity.private_file import write_private
from meshagent.models.names import HubName, parse_model_name
from meshagent.net.address import Address, is_loopback
from meshagent.placement.costs import MAX_CHAINS
from meshagent.placement.demand import DemandError, keep_alive_seconds

API_KEY_ENV = "MESHAGENT_API_KEY"  # an API key from the environment, for agents and clients
JOIN_ENV = "MESHAGENT_JOIN"  # an invite token from the environment, for `meshagent up`

DEFAULT_API_HOST = "127.0.0.1"
DEFAULT_API_PORT = 9337
DEFAULT_LISTEN = "0.0.0.0:9338"


_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SIZE_UNITS |= {"ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes in a size such as `300M`, `1.5G`, `512MiB`, `500k` or `1048576`."""
    t = text.strip().lower().removesuffix("b")
    digits = t.rstrip("kmgti")
    unit = t[len(digits) :]
    try:
        value = float(digits)
    except ValueError:
        value = -1.0
    if unit not in _SIZE_UNITS or value <= 0:
        raise ConfigError(f"{text!r} is not a size like 300M, 1.5G or 512MiB")
    return int(value * _SIZE_UNITS[unit])


# Settings in bytes that the CLI and config.toml may also give as sizes ("300M", "1.5G"); they
# are parsed once, when the config is merged, so a typo fails at start with its value named.
_SIZE_KEYS = frozenset({"max_memory", "max_vram", "prefix_cache"})


def _size_setting(key: str, text: str) -> int:
    if key == "prefix_cache" and text.strip().lower() in ("auto", "0", "off"):
        return PREFIX_CACHE_AUTO if text.strip().lower() == "auto" else 0
    if key == "max_vram" and text.strip().lower() in ("all", "0", "off"):
        return VRAM_ALL if text.strip().lower() == "all" else 0
    try:
        return parse_size(text)
    except ConfigError as e:
        raise ConfigError(f"{key.replace('_', '-')}: {e}") from None


VRAM_ALL = -1  # max_vram: every device's free memory, less a reserve
PREFIX_CACHE_AUTO = -1  # a share of the memory offered that the plan leaves free
PREFIX_CACHE_SHARE = 0.25  # auto: at most this share of the memory offered


def prefix_budget(setting: int, offered: int, needed: int) -> int:
    """Bytes of kept prefixes for a model whose part here needs `needed` of the `offered`
    bytes: never more than the plan leaves free, and for auto at most a share of the offer."""
    free = max(0, offered - needed)
    if setting == PREFIX_CACHE_AUTO:
        return min(free, int(offered * PREFIX_CACHE_SHARE))
    return min(free, setting)


@dataclass(frozen=True)
class AgentConfig:
    """Every setting `meshagent up` uses. CLI flags override the config file, which overrides
    these defaults."""

    name: str = ""
    # local GGUF files or hub names; none: the embedded default model
    models: tuple[str, ...] = ()
    api_host: str = DEFAULT_API_HOST
    api_port: int = DEFAULT_API_PORT
    # Also serve the API on this port, for tools that look for ollama there (11434); -1: off.
    ollama_port: int = -1
    api_keys: tuple[str, ...] = ()  # Bearer keys the HTTP API asks for; none: no key
    api_key_file: str = ""  # a file of more keys, one per line (config.toml or --api-key-file)
    insecure_no_api_key: bool = False  # serve a non-loopback API without a key anyway
    listen: str = DEFAULT_LISTEN  # the overlay's address; port 0 picks a free one
    peers: tuple[str, ...] = ()  # overlay addresses to dial at start (host:port)
    # overlay addresses to advertise besides this host's own (`--address`: a public IP that
    # forwards to the listen port, a name); peers try them first
    addresses: tuple[str, ...] = ()
    ctx_size: int = 2048  # tokens of context per slot
    slots: int = 4  # sequences decoded together
    max_queue: int = 64  # requests waiting for a slot before 429
    threads: int = 0  # 0: one per core
    grace: float = 10.0  # seconds in-flight requests get to finish on shutdown
    replay_deadline: float = 30.0  # seconds a request waits for a split that lost a stage
    # Many models: a model no request has asked for in this long unloads (ollama's
    # keep_alive: seconds or a duration like 5m; 0: after each request; negative: never).
    keep_alive: str = "5m"
    pins: tuple[str, ...] = ()  # models kept loaded whatever the demand (`--pin`)
    chains: int = 1  # chains a split this agent pins keeps at least, where memory holds them
    load_timeout: float = 600.0  # seconds a request waits for its model to load
    speculation: str = "auto"  # drafts from a request's own text: auto, on or off
    # A small model whose drafts the models served whole or entered here verify: a GGUF file,
    # a Hugging Face name, or "auto" (`serving/draft_loading.py`); "" for none.
    draft_model: str = ""
    # bytes of ended requests' KV kept for prompts that share their prefix; -1: auto, 0: off
    prefix_cache: int = PREFIX_CACHE_AUTO
    log_level: str = "info"
    relays: tuple[str, ...] = ()  # relay servers to register with (host:port)
    mdns: bool = True  # advertise and browse on the local network (not when listening on loopback)
    # how members know each other: "heartbeat" (gossip of heartbeats) or "swim" (probes,
    # docs/gossip.md); the gossip_interval, suspect_after and dead_after keys are heartbeat's
    membership: str = "swim"
    gossip_interval: float = 1.0  # seconds between heartbeats and gossip rounds
    suspect_after: float = 4.5  # seconds without a heartbeat before a peer is suspect
    dead_after: float = 8.0  # ...and before it is declared dead
    upgrade_interval: float = 5.0  # seconds between direct attempts to a relayed peer
    mem_weights_gib: float = 0.0  # memory offered for model weights; 0: measured
    mem_kv_gib: float = 0.0  # memory offered for KV cache; 0: measured
    max_memory: int = 0  # bytes: cap on all memory offered (weights + KV); 0: none
    # bytes: cap on the device (GPU) memory offered, all devices together; 0: none offered
    max_vram: int = VRAM_ALL
    # activations between stages: auto (cheapest certified exact, else f32), f16 or f32
    wire_dtype: str = "auto"

    def merged(self, overrides: dict[str, Any]) -> AgentConfig:
        known = {f.name for f in fields(self)}
        if isinstance(overrides.get("model"), str):  # config.toml's one-model key
            overrides = {**overrides, "models": (overrides["model"],)}
            overrides.pop("model")
        unknown = set(overrides) - known
        if unknown:
            raise ConfigError(f"unknown config keys: {', '.join(sorted(unknown))}")
        clean = {k: v for k, v in overrides.items() if v is not None}
        for k, v in clean.items():
            want = type(getattr(self, k))
            if k in _SIZE_KEYS and isinstance(v, str):
                clean[k] = _size_setting(k, v)
            elif want is float and isinstance(v, int):
                clean[k] = float(v)
            elif want is tuple and isinstance(v, list | tuple):
                clean[k] = tuple(str(x) for x in v)
            elif not isinstance(v, want):
                raise ConfigError(f"config key {k!r} must be a {want.__name__}, got {v!r}")
        return replace(self, **clean)

    def keep_alive_seconds(self) -> float:
        """`keep_alive` in seconds (negative: never unload)."""
        try:
            seconds = keep_alive_seconds(self.keep_alive)
        except DemandError as e:
            raise ConfigError(f"keep-alive: {e}") from e
        assert seconds is not None
        return seconds

    def validate(self) -> None:
        if not 0 <= self.api_port < 65536:
            raise ConfigError(
                f"api port {self.api_port} is out of range 0-65535 (0: any free port)"
            )
        if not -1 <= self.ollama_port < 65536:
            raise ConfigError(f"ollama port {self.ollama_port} is out of range 0-65535 (-1: off)")
        if any(not k.strip() for k in self.api_keys):
            raise ConfigError("an API key must not be empty")
        if not self.api_keys and not self.insecure_no_api_key and not is_loopback(self.api_host):
            raise ConfigError(
                f"the API would listen on {self.api_host}, reachable from other machines, "
                "without a key: anyone who reaches it could use the models and the control "
                f"endpoints. Give --api-key KEY (or ${API_KEY_ENV}), or --insecure-no-api-key to "
                "serve it open anyway."
            )
        if self.ctx_size < 64:
            raise ConfigError("ctx-size must be at least 64 tokens")
        if not 1 <= self.slots <= 64:
            raise ConfigError("slots must be between 1 and 64")
        if not 1 <= self.chains <= MAX_CHAINS:
            raise ConfigError(f"chains must be between 1 and {MAX_CHAINS}")
        if self.max_queue < 0:
            raise ConfigError("max-queue must be >= 0")
        if self.grace < 0:
            raise ConfigError("grace must be >= 0 seconds")
        if self.replay_deadline < 0:
            raise ConfigError("replay-deadline must be >= 0 seconds")
        if not self.load_timeout > 0:
            raise ConfigError(f"load-timeout must be > 0 seconds, got {self.load_timeout}")
        self.keep_alive_seconds()  # refuses what is not a duration, naming it
        for address in self.addresses:
            a = Address.parse(address)
            if a.port == 0:
                raise ConfigError(f"address {address!r}: give the port peers dial, not 0")
        # The gossip service's own rule, so that a config it refuses is refused here, by name.
        GossipConfig(
            interval=self.gossip_interval,
            suspect_after=self.suspect_after,
            dead_after=self.dead_after,
        ).validate()
        if self.max_memory < 0:
            raise ConfigError(f"max-memory must be >= 0 bytes (0: no cap), got {self.max_memory}")
        if self.max_vram < VRAM_ALL:
            raise ConfigError(f"max-vram must be a size, 0 (no GPU) or all, got {self.max_vram}")
        if self.membership not in ("heartbeat", "swim"):
            raise ConfigError(f"membership must be heartbeat or swim, got {self.membership!r}")
        if self.speculation not in ("auto", "on", "off"):
            raise ConfigError("speculation must be auto, on or off")
        if (
            self.draft_model
            and self.draft_model != "auto"
            and not isinstance(parse_model_name(self.draft_model), HubName)
            and not Path(self.draft_model).expanduser().is_file()
        ):
            raise ConfigError(
                f"draft-model: no GGUF file at {self.draft_model} (give a file, a Hugging Face "
                "name, or auto)"
            )
        if self.prefix_cache < PREFIX_CACHE_AUTO:
            raise ConfigError("prefix-cache must be a size, 0 (off) or auto")
        if self.wire_dtype not in ("auto", "f16", "f32"):
            raise ConfigError("wire-dtype must be auto, f16 or f32")
        if self.upgrade_interval <= 0 or self.mem_weights_gib < 0 or self.mem_kv_gib < 0:
            raise ConfigError("upgrade_interval must be > 0 and memory sizes >= 0")


def default_data_dir() -> Path:
    env = os.environ.get("MESHAGENT_DATA_DIR")
    if env:
        return Path(env)
    return Path(platformdirs.user_data_dir("meshagent", appauthor=False))


CONFIG_TEMPLATE = """\
# meshagent agent configuration. Command-line flags override these values.
# Uncomment and edit to change a default.
# models = ["ORG/REPO:Q4_K_M"]          # files or hub names; none: the mesh's catalogue
# name = "my-laptop"
# api_host = "127.0.0.1"
# api_port = 9337
# ollama_port = 11434   # also serve the API on ollama's port, for tools that look only there
# api_keys = ["a long random string"]   # clients send it as a Bearer key
# api_key_file = "/path/to/keys"        # or keys in a file of their own, one per line
# insecure_no_api_key = false           # true: serve a non-loopback API without a key
# listen = "0.0.0.0:9338"
# peers = ["192.168.1.20:9338"]
# addresses = ["203.0.113.7:9338"]
# ctx_size = 2048
# slots = 4
# threads = 0                           # compute threads; 0: one per core
# max_queue = 64
# grace = 10.0
# replay_deadline = 30.0
# keep_alive = "5m"
# pins = ["SmolLM2-135M-Instruct.Q4_1"]
# chains = 1                            # chains a split this agent pins keeps at least
# load_timeout = 600.0
# speculation = "auto"
# draft_model = "auto"    # or a GGUF file or a Hugging Face name: drafts for the models served
# prefix_cache = "auto"
# relays = ["relay.example.org:9339"]
# mdns = true
# membership = "swim"                   # or "heartbeat": a cost that grows with the mesh
# gossip_interval = 1.0
# suspect_after = 4.5
# dead_after = 8.0
# upgrade_interval = 5.0
# mem_weights_gib = 0.0
# mem_kv_gib = 0.0
# max_memory = "1.5G"
# max_vram = "all"                      # GPU memory offered; "0": none
# wire_dtype = "auto"                   # activations between stages: auto, f16 or f32
# log_level = "info"
"""


@dataclass(frozen=True)
class DataDir:
    root: Path

    @property
    def identity_path(self) -> Path:
        return self.root / "identity.key"

    @property
    def mesh_path(self) -> Path:
        return self.root / "mesh.key"

    @property
    def artifacts_path(self) -> Path:
        return self.root / "artifacts"

    @property
    def models_path(self) -> Path:
        """Partial copies of hub models: the stage-only downloads (`models/ranged.py`)."""
        return self.root / "models"

    @property
    def catalog_path(self) -> Path:
        """The mesh's catalogue of models as this agent knows it (`catalog/book_file.py`)."""
        return self.root / "catalog.cbor"

    @property
    def config_path(self) -> Path:
        return self.root / "config.toml"

    @property
    def known_path(self) -> Path:
        """The peers and relays this agent has known (`discovery/known.py`)."""
        return self.root / "known.json"

    @property
    def run_path(self) -> Path:
        """Where a running agent writes how to reach its control API."""
        return self.root / "agent.json"

    def ensure(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not self.config_path.exists():
            # Private from the start: the file is where API keys may be written.
            write_private(self.config_path, CONFIG_TEMPLATE.encode())

    def load_config(self) -> dict[str, Any]:
        if not self.config_path.exists():
            return {}
        try:
            return tomllib.loads(self.config_path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{self.config_path}: {e}") from e
