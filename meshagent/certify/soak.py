"""The soak: the model split across three real agent processes on loopback, against one agent
serving it whole, through the OpenAI API.

The engine-level checks (`checks.py`) compare logits in one process; the soak runs what users
run: placement negotiating a three-stage split (each agent offers too little memory for the
model alone), stages on separate processes talking over the encrypted overlay, the scheduler,
sampling and detokenisation. Every split agent answers each prompt, greedy, non-streamed and
streamed, and each text must equal the whole agent's.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

from meshagent import capacity
from meshagent.certify.checks import Progress
from meshagent.certify.prompts import Prompt
from meshagent.identity.mesh import Invite, encode_invite
from meshagent.identity.mesh_file import load_mesh
from meshagent.launch import AgentProcess, start_agent
from meshagent.models.capability import CapabilityStore, SignedRecord
from meshagent.models.layout import ModelLayout
from meshagent.placement.planner import ModelCost, PeerCapacity, PlanError, plan
from meshagent.sse_client import StreamIncomplete, completion_text, iter_events

AGENTS = 3
HEADROOM = 0.1  # placement's default
READY_TIMEOUT = 180.0


@dataclass(frozen=True)
class SoakResult:
    wire_dtype: str
    stages: tuple[tuple[int, int], ...]
    requests: int
    identical: int
    seconds: float
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and self.identical == self.requests

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def memory_cap(layout: ModelLayout, context_tokens: int) -> int:
    """An offer per agent that makes placement split the model into exactly three stages.
    The agents run on this machine, so llama.cpp's compute buffers go to the memory it has
    beyond their offers, as each agent will tell the mesh (`capacity.spare_memory`)."""
    cost = replace(ModelCost.from_layout("m", layout), split_refusal=None)
    available = capacity.memory_available()
    whole = cost.offer_bytes(0, layout.n_layers, context_tokens, spare=available)
    for share in (0.45, 0.5, 0.55, 0.6):
        cap = int(whole * share / (1 - HEADROOM))
        spare = capacity.spare_memory(available, capacity.MemoryOffer.split(cap))
        peers = [PeerCapacity(str(i), cap, 1.0, {}, spare_bytes=spare) for i in range(AGENTS)]
        try:
            p = plan(cost, peers, context_tokens=context_tokens, headroom=HEADROOM)
        except PlanError:
            continue
        if len(p.stages) == AGENTS:
            return cap
    raise PlanError(f"found no memory offer that splits {layout.name} into {AGENTS} stages")


def _text(agent: AgentProcess, model_id: str, prompt: Prompt, tokens: int, stream: bool) -> str:
    body: dict = {"model": model_id, "max_tokens": tokens, "temperature": 0, "stream": stream}
    chat = prompt.chat
    if chat:
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    url = f"{agent.url}/v1/{'chat/completions' if chat else 'completions'}"
    with httpx.stream("POST", url, json=body, timeout=300) as r:
        if r.status_code != 200 or not stream:
            r.read()
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {r.text[:300]}")
        if not stream:
            choice = r.json()["choices"][0]
            return choice["message"]["content"] if chat else choice["text"]
        try:
            return completion_text(iter_events(r))
        except StreamIncomplete as e:
            raise RuntimeError(f"{url}: {e}") from e


def _wait_split(agents: Sequence[AgentProcess], model_id: str) -> tuple[tuple[int, int], ...]:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        try:
            ps = [
                httpx.get(f"{a.url}/control/status", timeout=5).json()["placement"][model_id]
                for a in agents
            ]
        except (httpx.HTTPError, KeyError, ValueError):
            ps = []
        if ps and all(p["routable"] and len(p["stages"]) == AGENTS for p in ps):
            return tuple((s[1], s[2]) for s in ps[0]["stages"])
        time.sleep(0.25)
    raise TimeoutError(f"the agents did not agree on a {AGENTS}-stage split in {READY_TIMEOUT} s")


def soak(
    layout: ModelLayout,
    signed: SignedRecord,
    prompts: Sequence[Prompt],
    *,
    wire_dtype: str,
    tokens: int,
    ctx: int,
    threads: int,
    progress: Progress = lambda _: None,
) -> SoakResult:
    """Run the soak; failures to start or agree come back as `error`, never raised."""
    t0 = time.monotonic()
    model_id = Path(layout.path).name.removesuffix(".gguf")
    common = ["--model", layout.path, "--slots", "1", "--ctx-size", str(ctx)]
    common += ["--threads", str(threads or 1), "--wire-dtype", wire_dtype]
    started: list[AgentProcess] = []
    stages: tuple[tuple[int, int], ...] = ()
    requests = identical = 0
    try:
        with tempfile.TemporaryDirectory(prefix="meshagent-soak-") as tmp:
            root = Path(tmp)
            cap = str(memory_cap(layout, ctx))
            # The first agent holds the record; the others hear it by gossip, as in a mesh.
            CapabilityStore(root / "a" / "artifacts" / "capabilities").put(signed)
            first = start_agent(root / "a", *common, "--max-memory", cap, wait_model=False)
            started.append(first)
            listen = json.loads((root / "a" / "agent.json").read_text())["listen"]
            token = encode_invite(Invite(load_mesh(root / "a" / "mesh.key"), tuple(listen), ()))
            for name in ("b", "c"):
                started.append(
                    start_agent(
                        root / name,
                        *common,
                        "--max-memory",
                        cap,
                        "--join",
                        token,
                        wait_model=False,
                    )
                )
            started.append(start_agent(root / "whole", *common))  # a mesh of its own
            progress("soak: 4 agents started; waiting for a 3-stage split")
            stages = _wait_split(started[:AGENTS], model_id)
            progress(f"soak: split {stages}")
            for p in prompts:
                for stream in (False, True):
                    want = _text(started[-1], model_id, p, tokens, stream)
                    for agent in started[:AGENTS]:
                        requests += 1
                        identical += _text(agent, model_id, p, tokens, stream) == want
                progress(f"soak: {p.name}: {identical}/{requests} identical so far")
    except (OSError, RuntimeError, TimeoutError, PlanError, httpx.HTTPError) as e:
        return SoakResult(wire_dtype, stages, requests, identical, time.monotonic() - t0, str(e))
    finally:
        for agent in started:
            agent.stop()
    return SoakResult(wire_dtype, stages, requests, identical, time.monotonic() - t0)
