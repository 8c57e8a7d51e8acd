"""Ollama's endpoints about models, for the tools that call them before anything else:
`GET /api/version`, `POST /api/show` (details, parameters, template, model info,
capabilities), `POST /api/pull` (a hub model added to the mesh's catalogue, its download's
progress streamed as ollama streams it), `POST /api/embed` and the older `POST
/api/embeddings` (answered as `/v1/embeddings`)."""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING, Any

import trio

from meshagent.api.catalog import Catalog
from meshagent.api.embeddings import parse_embedding
from meshagent.api.errors import ApiError, bad_request
from meshagent.api.exchange import Exchange
from meshagent.catalog.service import CatalogError
from meshagent.errors import ModelError

if TYPE_CHECKING:
    from meshagent.api.openai_routes import OpenAIRoutes

# The ollama API whose endpoints this agent answers (tools compare it with the version they
# need; meshagent's own version is in `meshagent --version`).
OLLAMA_API_VERSION = "0.9.0"
NDJSON = "application/x-ndjson"
PULL_TICK = 0.25  # seconds between a pull's progress lines


def model_name(name: Any) -> str:
    """Ollama's names carry a tag (`:latest` when none is given); ours have none."""
    if not isinstance(name, str) or not name:
        raise bad_request("Missing required parameter: 'model'.", param="model")
    return name.removesuffix(":latest")


def show(catalog: Catalog, name: str) -> dict[str, Any]:
    """`/api/show` of the model called `name` (404 if the mesh has none)."""
    card = catalog.card(name)
    info = card.get("meshagent") or {}
    arch = info.get("architecture", "")
    local = catalog.local(name)
    template, family_of_template = "", ""
    capabilities = ["completion"]
    if local is not None:
        template = local.template.source
        family_of_template = local.template.name
        capabilities.append("tools")
        if local.embedder is not None:
            capabilities.append("embedding")
    model_info: dict[str, Any] = {"general.architecture": arch}
    if info.get("layers") is not None:
        model_info[f"{arch}.block_count"] = info["layers"]
    if info.get("context_length") is not None:
        model_info[f"{arch}.context_length"] = info["context_length"]
    return {
        "modelfile": f"# served by meshagent\nFROM {card['id']}\n",
        "parameters": "",
        "template": template,
        "details": {
            "parent_model": "",
            "format": "gguf",
            "family": arch,
            "families": [arch] if arch else [],
            "parameter_size": "",
            "quantization_level": "",
        },
        "model_info": model_info,
        "capabilities": capabilities,
        "modified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(card.get("created", 0))),
        "meshagent": {"chat_template": family_of_template, **info},
    }


class _Progress:
    """A download's progress as the worker thread reports it and the event loop reads it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.done = self.total = 0

    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            self.done, self.total = done, total

    def read(self) -> tuple[int, int]:
        with self._lock:
            return self.done, self.total


async def pull(ex: Exchange, catalog: Catalog, body: dict[str, Any]) -> None:
    """`/api/pull`: the model added to the mesh's catalogue (a hub name downloads here first);
    streamed, a line per progress step and `{"status": "success"}` at the end."""
    spec = body.get("model") or body.get("name")
    if not isinstance(spec, str) or not spec.strip():
        raise bad_request("Missing required parameter: 'model'.", param="model")
    if catalog.catalogue is None:
        raise ApiError(404, "This agent has no catalogue of models to pull into.")
    stream = body.get("stream", True) is not False
    progress = _Progress()
    result: dict[str, Any] = {}

    async def add() -> None:
        try:
            signed = await catalog.catalogue.add(model_name(spec).strip(), progress)  # type: ignore[union-attr]
            result["digest"] = "sha256:" + signed.entry.sha256
        except (ModelError, CatalogError) as e:
            result["error"] = str(e)

    if not stream:
        await add()
        if "error" in result:
            await ex.send_json(400, {"error": result["error"]})
        else:
            await ex.send_json(200, {"status": "success"})
        return

    async def line(data: dict[str, Any]) -> None:
        await ex.send_raw((json.dumps(data) + "\n").encode())

    await ex.start(200, [(b"content-type", NDJSON.encode())])
    await line({"status": "pulling manifest"})
    sent = (-1, -1)

    async def report() -> None:
        nonlocal sent
        now = progress.read()
        if now != sent and now[1]:
            sent = now
            step = {"status": f"pulling {spec}", "digest": spec}
            await line({**step, "total": now[1], "completed": now[0]})

    async with trio.open_nursery() as nursery:
        nursery.start_soon(add)
        while not result:
            await report()
            await trio.sleep(PULL_TICK)
    await report()  # the last step, however fast it came
    if "error" in result:
        await line({"error": result["error"]})
    else:
        await line({"status": "verifying sha256 digest", "digest": result["digest"]})
        await line({"status": "success"})
    await ex.end()


async def embed(ex: Exchange, openai: OpenAIRoutes, body: dict[str, Any], *, old: bool) -> None:
    """`/api/embed` (`input`: a text or texts) or, `old`, `/api/embeddings` (`prompt`)."""
    t0 = time.perf_counter_ns()
    given = body.get("prompt") if old else body.get("input")
    if given is None:
        param = "prompt" if old else "input"
        raise bad_request(f"Missing required parameter: '{param}'.", param=param)
    request = {"model": model_name(body.get("model")), "input": given}
    req = parse_embedding(request)
    name, vectors, tokens, _ = await openai.embed(ex, req, json.dumps(request).encode())
    if old:
        await ex.send_json(200, {"embedding": vectors[0]})
        return
    took = time.perf_counter_ns() - t0
    await ex.send_json(
        200,
        {
            "model": name,
            "embeddings": vectors,
            "total_duration": took,
            "load_duration": 0,
            "prompt_eval_count": tokens,
        },
    )
