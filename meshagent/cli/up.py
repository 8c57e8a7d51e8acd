"""`meshagent up`: start an agent and serve the OpenAI-compatible API."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import structlog
import trio

from meshagent import capacity, logs
from meshagent.agent import Agent
from meshagent.cli.common import add_data_dir, data_dir_from
from meshagent.cli.progress import ProgressBar
from meshagent.cli.secrets import gather, read_key_file
from meshagent.config import API_KEY_ENV, JOIN_ENV, AgentConfig, DataDir
from meshagent.identity.mesh import MeshSecret, decode_invite
from meshagent.identity.mesh_file import load_mesh
from meshagent.models.default import resolve_model
from meshagent.models.header_map import HeaderMap
from meshagent.models.header_share import ask_peers
from meshagent.models.hub import model_for_agent
from meshagent.models.names import HubName, parse_model_name
from meshagent.net.address import Address, is_loopback
from meshagent.services import Services
from meshagent.serving.mesh_directory import UNSERVED_SETTLE
from meshagent.serving.mesh_model import MeshModel
from meshagent.wording import not_served

log = structlog.get_logger(__name__)

_SAY_EVERY = 0.5  # seconds between looks at whether the model is served


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up",
        help="start an agent and serve the API on localhost",
        description="Start an agent and serve the API on localhost. To add this machine to "
        "a mesh: `meshagent invite` on a member, then `meshagent up --join -` here and paste "
        "the token. The machines must reach each other on the --listen port (TCP; on one LAN "
        "they find each other by mDNS), or share a relay (--relay).",
    )
    d = AgentConfig()
    p.add_argument(
        "--model",
        action="append",
        dest="models",
        metavar="MODEL",
        help="a local GGUF file, or a Hugging Face name: ORG/REPO, ORG/REPO:QUANT or "
        "ORG/REPO/FILE.gguf (repeatable: one agent takes part in several models; default: "
        "the embedded SmolLM2-135M)",
    )
    p.add_argument(
        "--name", metavar="NAME", help="a human name for this agent (default: the host name)"
    )
    p.add_argument("--api-host", metavar="HOST", help=f"address of the API (default {d.api_host})")
    p.add_argument(
        "--api-port", metavar="PORT", type=int, help=f"port of the API (default {d.api_port})"
    )
    p.add_argument(
        "--ollama-port",
        metavar="PORT",
        type=int,
        help="also serve the API on this port of --api-host, for tools that speak only "
        "ollama's protocol and look for it there (ollama's own: 11434; default off)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        dest="api_keys",
        metavar="KEY",
        help=f"a key clients must send as 'Authorization: Bearer KEY' on every endpoint but "
        "/health (repeatable; '-' reads it from standard input; a KEY given here is visible "
        f"to other users in the process list: prefer --api-key-file or ${API_KEY_ENV}; "
        "default: api_keys in config.toml, else none, which only a loopback --api-host allows)",
    )
    p.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="a file holding API keys, one per line (keep it mode 600); added to --api-key "
        f"and ${API_KEY_ENV}",
    )
    p.add_argument(
        "--insecure-no-api-key",
        action="store_const",
        const=True,
        help="serve an API that listens beyond loopback without a key (anyone who reaches it "
        "can use it)",
    )
    p.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="where this agent listens for its peers (the overlay between agents; default "
        f"{d.listen}); the addresses it advertises are this host's at that port",
    )
    p.add_argument(
        "--peer",
        action="append",
        dest="peers",
        metavar="HOST:PORT",
        help="another agent's address (as its status lists under addresses) to dial at "
        "start (repeatable)",
    )
    p.add_argument(
        "--address",
        action="append",
        dest="addresses",
        metavar="HOST:PORT",
        help="an address to advertise to peers besides this host's own, for one they reach "
        "but this host cannot see (a public IP forwarded to --listen's port; repeatable)",
    )
    p.add_argument(
        "--join",
        metavar="TOKEN",
        help="join the mesh of this invite (from `meshagent invite`); replaces the stored mesh. "
        "'-' reads the token from standard input; a TOKEN given here (it carries the mesh "
        f"secret) is visible to other users in the process list: prefer '-', --join-file or "
        f"${JOIN_ENV}",
    )
    p.add_argument(
        "--join-file",
        metavar="PATH",
        help="join the mesh of the invite token in this file (as --join)",
    )
    p.add_argument(
        "--relay",
        action="append",
        dest="relays",
        metavar="HOST:PORT",
        help="a relay to register with, for peers that cannot reach us directly (repeatable)",
    )
    p.add_argument(
        "--no-mdns",
        dest="mdns",
        action="store_const",
        const=False,
        help="do not advertise or browse on the local network (mDNS)",
    )
    p.add_argument(
        "--ctx-size",
        metavar="TOKENS",
        type=int,
        help=f"context tokens per slot (default {d.ctx_size})",
    )
    p.add_argument(
        "--slots", metavar="N", type=int, help=f"requests decoded together (default {d.slots})"
    )
    p.add_argument(
        "--max-queue",
        metavar="N",
        type=int,
        help=f"requests waiting for a slot before answering 429 (default {d.max_queue})",
    )
    p.add_argument(
        "--threads", metavar="N", type=int, help="compute threads (default: one per core)"
    )
    p.add_argument(
        "--max-memory",
        metavar="SIZE",
        help="cap on the memory this agent offers the mesh for weights and KV cache, e.g. "
        "300M or 1.5G (default: what the system has available, less 1 GB)",
    )
    p.add_argument(
        "--max-vram",
        metavar="SIZE",
        help="cap on the GPU memory this agent offers the mesh, all devices together, e.g. "
        "20G; 0 offers none; all (the default): each GPU's free memory, less 500 MB (a CPU "
        "build of llama.cpp has no GPU)",
    )
    p.add_argument(
        "--wire-dtype",
        choices=("auto", "f16", "f32"),
        help="activations between the stages of a split, as the entry stage sends them "
        "(default auto: the cheapest dtype the model's capability record certifies exact, "
        "else f32)",
    )
    p.add_argument(
        "--grace",
        metavar="SECONDS",
        type=float,
        help=f"seconds in-flight requests get to finish on shutdown (default {d.grace})",
    )
    p.add_argument(
        "--replay-deadline",
        type=float,
        metavar="SECONDS",
        help="how long a request whose split lost a stage waits for the split to serve again "
        f"before it fails (default {d.replay_deadline}; 0: fail at once)",
    )
    p.add_argument(
        "--keep-alive",
        metavar="DURATION",
        help="how long a model no request asks for stays loaded: seconds or a duration like "
        f"5m or 1h (default {d.keep_alive}; 0: unload after each request; -1: never); a "
        "request's own keep_alive (ollama's field) sets it for its model",
    )
    p.add_argument(
        "--pin",
        action="append",
        dest="pins",
        metavar="MODEL",
        help="keep this model loaded whatever the demand (repeatable)",
    )
    p.add_argument(
        "--chains",
        metavar="N",
        type=int,
        help="keep at least N chains of a split model this agent pins (--model, --pin), each "
        "the whole model over agents of its own, where the mesh has the memory: throughput "
        f"for many clients (default {d.chains}: more only as demand asks)",
    )
    p.add_argument(
        "--load-timeout",
        type=float,
        metavar="SECONDS",
        help="how long a request waits for its model to be loaded somewhere in the mesh "
        f"before it gets a 503 (default {d.load_timeout:g})",
    )
    p.add_argument(
        "--membership",
        choices=("heartbeat", "swim"),
        help=f"how members know each other (default {d.membership}; swim: by probes, at a "
        "cost per agent that does not grow with the mesh; heartbeat: gossip of heartbeats "
        "over a connection to every member; docs/gossip.md)",
    )
    p.add_argument(
        "--speculation",
        choices=("auto", "on", "off"),
        help=f"speculative decoding for requests that do not choose (default {d.speculation}: "
        "only where it changes no token; docs/speculation.md)",
    )
    p.add_argument(
        "--draft-model",
        metavar="PATH|NAME|auto",
        help="a small model (a GGUF file or a Hugging Face name; auto: the embedded SmolLM2, "
        "for models at least 6 times its size) that drafts for the models this agent serves "
        "whole or as a split's entry; speculating requests verify its drafts (its memory is "
        "taken from the offer; docs/speculation.md)",
    )
    p.add_argument(
        "--prefix-cache",
        metavar="SIZE",
        help="memory for the KV cache of ended requests, reused by later prompts that start "
        "with the same tokens (a system prompt, a conversation's history), e.g. 200M; 0 or "
        "off: none (default auto: what the model's plan leaves free of the memory offered, "
        "at most a quarter of it; docs/serving.md)",
    )
    p.add_argument("--log-level", choices=logs.LEVELS, help="default info")
    p.add_argument(
        "--log-format",
        choices=("auto", "json", "console"),
        default="auto",
        help="auto: pretty on a terminal, JSON lines otherwise",
    )
    add_data_dir(p)
    p.set_defaults(run=run)


def _header_map_from(
    peers: tuple[str, ...], join: MeshSecret | None, data_dir: DataDir
) -> Callable[[str], HeaderMap | None] | None:
    """Asks the peers this agent was told of (`--join`, `--peer`) where a model file's
    tokenizer lies in its header, before the agent starts: none without peers or a mesh."""
    mesh = join
    if mesh is None and data_dir.mesh_path.exists():
        mesh = load_mesh(data_dir.mesh_path)
    if mesh is None or not peers:
        return None
    return lambda sha256: ask_peers(peers, mesh, sha256)


def run(args: argparse.Namespace) -> int:
    data_dir = data_dir_from(args)
    data_dir.ensure()
    overrides = {
        k: getattr(args, k)
        for k in (
            "models",
            "name",
            "api_host",
            "api_port",
            "ollama_port",
            "insecure_no_api_key",
            "listen",
            "ctx_size",
            "slots",
            "max_queue",
            "threads",
            "max_memory",
            "max_vram",
            "wire_dtype",
            "grace",
            "replay_deadline",
            "keep_alive",
            "pins",
            "chains",
            "load_timeout",
            "speculation",
            "draft_model",
            "membership",
            "prefix_cache",
            "log_level",
            "mdns",
            "addresses",
        )
    }
    secrets = gather(
        api_keys=args.api_keys,
        api_key_file=args.api_key_file,
        join=args.join,
        join_file=args.join_file,
        environ=os.environ,
    )
    join = None
    peers = tuple(args.peers or ())
    relays = tuple(args.relays or ())
    if secrets.join is not None:
        invite = decode_invite(secrets.join)
        join = invite.secret
        peers += tuple(a for a in invite.bootstrap if a not in peers)
        relays += tuple(a for a in invite.relays if a not in relays)
    for address in (*peers, *relays):
        Address.parse(address)  # refuse a typo now, with the flag's value in the message
    # Keys given to this command replace those of config.toml (its api_keys and api_key_file).
    overrides["api_keys"] = secrets.api_keys or None
    overrides["peers"] = peers or None
    overrides["relays"] = relays or None
    config = AgentConfig().merged(data_dir.load_config()).merged(overrides)
    if not secrets.api_keys and config.api_key_file:
        config = config.merged({"api_keys": config.api_keys + read_key_file(config.api_key_file)})
    config.validate()
    resolved = []
    for model in config.models:
        name = parse_model_name(model)
        if isinstance(name, HubName):
            # A name is resolved here, before the agent starts: downloaded whole with
            # progress on stderr, or (more than this agent can hold) its header only.
            offer = capacity.memory_offer(
                capacity.memory_available(),
                limit=config.max_memory,
                weights=int(config.mem_weights_gib * (1 << 30)),
                kv=int(config.mem_kv_gib * (1 << 30)),
            )
            model = str(
                model_for_agent(
                    name,
                    data_dir.models_path,
                    offer.weights,
                    progress=ProgressBar(f"downloading {model}"),
                    say=lambda line: print(f"meshagent: {line}", file=sys.stderr),
                    header_map=_header_map_from(peers, join, data_dir),
                )
            )
        resolved.append(model)
    config = config.merged({"models": tuple(resolved)})
    if config.draft_model:
        config = config.merged({"draft_model": _draft_model_file(config.draft_model)})
    fmt = {"auto": None, "json": True, "console": False}[args.log_format]
    logs.configure(config.log_level, json=fmt)
    for e in secrets.exposed:
        log.warning(
            "secret.on_command_line",
            flag=e.flag,
            why="every user of this machine can read it in the process list",
            fix=e.fix,
        )
    agent = Agent(config, data_dir, join=join)

    async def main() -> None:
        async with trio.open_nursery() as nursery:

            async def run_agent(task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
                await agent.run(task_status=task_status)
                nursery.cancel_scope.cancel()  # the agent stopped (SIGINT): so do the lines

            services = await nursery.start(run_agent)
            names = ", ".join(services.models.names)
            doing = (
                f"placing {names} on the mesh"
                if names
                else "serving the mesh's models (the embedded default on a new mesh)"
            )
            print(
                f"meshagent: API at {services.api_url}/v1 (console: {services.api_url}/console); "
                f"{doing}",
                file=sys.stderr,
            )
            if not config.api_keys and not is_loopback(config.api_host):
                print(
                    f"meshagent: WARNING: the API at {services.api_url} has no key "
                    "(--insecure-no-api-key): anyone who reaches it can use it",
                    file=sys.stderr,
                )
            nursery.start_soon(_say_what_each_serves, services)
            nursery.start_soon(_say_if_alone, services)

    trio.run(main)
    return 0


async def _say_if_alone(services: Services) -> None:
    """Once, if the agent says it is alone though told where its mesh is
    (`discovery/alone.py`): which addresses it tried, and what to try instead."""
    while services.alone_note is None:
        await trio.sleep(_SAY_EVERY)
    if services.alone is not None:
        print(f"meshagent: {services.alone}", file=sys.stderr)


async def _say_what_each_serves(services: Services) -> None:
    """A line for each model this agent takes part in, from when it takes part on (models
    come and go with the mesh's catalogue)."""
    said: set[str] = set()
    async with trio.open_nursery() as nursery:
        while True:
            added = services.models.added
            for model in services.models:
                if model.info.id not in said:
                    said.add(model.info.id)
                    nursery.start_soon(_say_what_serves, model, services.api_url)
            await added.wait()


async def _say_what_serves(model: MeshModel, api_url: str) -> None:
    """A line on stderr whenever the model's state changes: served on the mesh (here or by
    peers), or not, and why. A reason is said once it has held for `UNSERVED_SETTLE` seconds: while
    an agent starts, its own memory is not yet counted and the mesh looks empty."""
    said = None
    seen, since = None, 0.0
    while True:
        p = model.placement_summary()
        if p["routable"]:
            line = f"serving {model.info.id} at {api_url}/v1"
        elif p["error"]:
            line = not_served(model.info.id, p["error"])
        else:
            line = None  # a plan is being agreed or loaded
        if line != seen:
            seen, since = line, trio.current_time()
        settled = p["routable"] or trio.current_time() - since >= UNSERVED_SETTLE
        if line is not None and line != said and settled:
            print(f"meshagent: {line}", file=sys.stderr)
            said = line
        await trio.sleep(_SAY_EVERY)


def _draft_model_file(spec: str) -> str:
    """What `--draft-model` names, for the agent: `auto` as it is (`serving/draft_loading.py`
    picks the model), a Hugging Face name downloaded into its cache (with progress, as a
    `--model` name is) and given as its file, a file as it is."""
    if spec == "auto" or not isinstance(parse_model_name(spec), HubName):
        return spec
    return str(resolve_model(spec, progress=ProgressBar(f"downloading {spec}")))
