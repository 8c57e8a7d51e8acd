"""Ollama's endpoints, for tools that speak only its protocol: `GET /api/tags`, `GET /api/ps`
(the models loaded in the mesh and when each unloads), `POST /api/chat` and `POST
/api/generate`, answered as chat or text completions (`Completions`: routed, carried,
replayed and metered like any request); the endpoints about models are `ollama_models.py`'s.
Streams are newline-delimited JSON, as ollama's are, and stream by default.

Options mapped: `temperature`, `top_p`, `top_k`, `num_predict`, `seed`, `stop`,
`presence_penalty`, `frequency_penalty`, `repeat_penalty`. Accepted and left to the agent,
which sets them for every request: `num_ctx` (its `--ctx-size`), `num_batch`, `num_gpu`,
`main_gpu`, `num_thread`, `num_keep`, `use_mmap`, `use_mlock`, `numa`, `low_vram`,
`vocab_only`. Any other option is refused by name (400). `format` (JSON or a schema) and
tools are enforced by grammar; images are refused. `/api/generate`'s `suffix` (fill in the
middle) is refused unless the model's vocabulary has fill-in-the-middle tokens. Errors are
ollama's shape, `{"error": "..."}`."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING, Any

from meshagent.api import ollama_models
from meshagent.api.catalog import Catalog
from meshagent.api.completion_events import Completion, Failed, unwrap
from meshagent.api.completions import Completions
from meshagent.api.errors import ApiError, bad_request
from meshagent.api.exchange import Exchange, Routes
from meshagent.api.ollama_models import NDJSON, model_name
from meshagent.api.replies import Output
from meshagent.api.tools import Call

if TYPE_CHECKING:
    from meshagent.api.openai_routes import OpenAIRoutes

_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "num_predict": "max_tokens",
    "seed": "seed",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
_EXTENSIONS = {"top_k": "top_k", "repeat_penalty": "repeat_penalty"}  # the `meshagent` object's
# How the agent runs its models, set for all of its requests: accepted, not changed by one.
_AGENTS_OWN = frozenset(
    {
        "num_ctx",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "num_thread",
        "num_keep",
        "use_mmap",
        "use_mlock",
        "numa",
        "low_vram",
        "vocab_only",
    }
)


def tags(models: list[dict[str, Any]]) -> dict[str, Any]:
    """`/api/tags` from the cards of `/v1/models`."""
    out = []
    for card in models:
        info = card.get("meshagent") or {}
        out.append(
            {
                "name": card["id"],
                "model": card["id"],
                "modified_at": datetime.fromtimestamp(card.get("created", 0), UTC).isoformat(),
                "size": info.get("size_bytes", 0),
                "digest": info.get("sha256", ""),
                "details": {
                    "format": "gguf",
                    "family": info.get("architecture", ""),
                    "parameter_size": "",
                    "quantization_level": "",
                },
            }
        )
    return {"models": out}


def running(models: list[dict[str, Any]], expiry: Callable[[str], float | None]) -> dict:
    """`/api/ps` from the cards of `/v1/models`: the models loaded somewhere in the mesh,
    each with when it unloads (`expiry`: unix time, inf for never, None unknown)."""
    out = []
    for entry in tags([c for c in models if (c.get("meshagent") or {}).get("loaded")])["models"]:
        ends = expiry(entry["name"])
        if ends is None or math.isinf(ends):
            expires = NEVER
        else:
            expires = datetime.fromtimestamp(ends, UTC).isoformat()
        out.append({**entry, "expires_at": expires, "size_vram": 0})
    return {"models": out}


# Ollama says a model kept loaded for ever expires at a time far away.
NEVER = "2318-01-01T00:00:00+00:00"


def _refuse(body: dict[str, Any]) -> None:
    messages = body.get("messages") or []
    if body.get("images") or any(isinstance(m, dict) and m.get("images") for m in messages):
        raise bad_request("Images are not supported.", param="images", code="unsupported_parameter")


def _openai_body(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": model_name(body.get("model")),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise bad_request("'options' must be an object.", param="options")
    for key in options:
        if key not in _OPTIONS and key not in _EXTENSIONS and key not in _AGENTS_OWN:
            raise bad_request(
                f"The option '{key}' is not supported.",
                param=f"options.{key}",
                code="unsupported_parameter",
            )
    for theirs, ours in _OPTIONS.items():
        if options.get(theirs) is not None:
            out[ours] = options[theirs]
    extensions = {ours: options[k] for k, ours in _EXTENSIONS.items() if options.get(k) is not None}
    if extensions:
        out["meshagent"] = extensions
    if out.get("max_tokens") is not None and out["max_tokens"] < 0:
        del out["max_tokens"]  # ollama's -1: until the context is full
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):  # a JSON schema
        schema = {"name": "format", "schema": fmt, "strict": True}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt:
        raise bad_request("'format' must be \"json\" or a JSON schema.", param="format")
    if body.get("tools"):
        out["tools"] = body["tools"]
    if "keep_alive" in body:  # how long the model stays loaded after this request
        out["keep_alive"] = body["keep_alive"]
    return out


def chat_request(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """`/api/chat` as the OpenAI path and body that answer it."""
    _refuse(body)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request("Missing required parameter: 'messages'.", param="messages")
    out = _openai_body(body)
    out["messages"] = [_message(m) for m in messages if isinstance(m, dict)]
    return "/v1/chat/completions", out


def _message(m: dict[str, Any]) -> dict[str, Any]:
    out = {"role": m.get("role"), "content": m.get("content", "")}
    calls = m.get("tool_calls")
    if isinstance(calls, list):  # ollama's: {"function": {"name", "arguments": {...}}}
        out["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": c.get("function", {})}
            for i, c in enumerate(calls)
            if isinstance(c, dict)
        ]
    return out


def generate_request(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """`/api/generate` as the OpenAI path and body: raw prompts go to completions, others
    through the chat template (as ollama does), with `system` before them."""
    _refuse(body)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("Missing required parameter: 'prompt'.", param="prompt")
    out = _openai_body(body)
    suffix = body.get("suffix")
    if suffix:  # fill in the middle: the model's own tokens around prompt and suffix
        if not isinstance(suffix, str):
            raise bad_request("'suffix' must be text.", param="suffix")
        return "/v1/completions", {**out, "prompt": prompt, "suffix": suffix}
    if body.get("raw"):
        out["prompt"] = prompt
        return "/v1/completions", out
    system = body.get("system")
    out["messages"] = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    return "/v1/chat/completions", out


class OllamaRoutes:
    """Ollama's endpoints, over `catalog`'s model cards and the completions of
    `completions`."""

    def __init__(self, catalog: Catalog, completions: Completions, openai: OpenAIRoutes) -> None:
        self.catalog = catalog
        self.completions = completions
        self.openai = openai
        self.routes: Routes = {
            ("GET", "/api/tags"): self._tags,
            ("GET", "/api/ps"): self._ps,
            ("GET", "/api/version"): self._version,
            ("POST", "/api/show"): self._show,
            ("POST", "/api/pull"): self._pull,
            ("POST", "/api/embed"): partial(self._embed, old=False),
            ("POST", "/api/embeddings"): partial(self._embed, old=True),
            ("POST", "/api/chat"): partial(self._answer, chat=True),
            ("POST", "/api/generate"): partial(self._answer, chat=False),
        }

    async def _version(self, ex: Exchange) -> None:
        await ex.send_json(200, {"version": ollama_models.OLLAMA_API_VERSION})

    async def _object(self, ex: Exchange) -> dict[str, Any]:
        body = await ex.json_body()
        if not isinstance(body, dict):
            raise bad_request("The request body must be a JSON object.")
        return body

    async def _show(self, ex: Exchange) -> None:
        try:
            body = await self._object(ex)
            name = model_name(body.get("model") or body.get("name"))
            await ex.send_json(200, ollama_models.show(self.catalog, name))
        except ApiError as e:
            await ex.send_json(e.status, {"error": e.message})

    async def _pull(self, ex: Exchange) -> None:
        try:
            await ollama_models.pull(ex, self.catalog, await self._object(ex))
        except ApiError as e:
            await ex.send_json(e.status, {"error": e.message})

    async def _embed(self, ex: Exchange, *, old: bool) -> None:
        try:
            await ollama_models.embed(ex, self.openai, await self._object(ex), old=old)
        except ApiError as e:
            await ex.send_json(e.status, {"error": e.message})

    async def _tags(self, ex: Exchange) -> None:
        await ex.send_json(200, tags(self.catalog.cards()))

    async def _ps(self, ex: Exchange) -> None:
        loads = self.catalog.loads
        expiry = loads.expires_at if loads is not None else (lambda name: None)
        await ex.send_json(200, running(self.catalog.cards(), expiry))

    async def _answer(self, ex: Exchange, *, chat: bool) -> None:
        """`/api/chat` when `chat`, else `/api/generate`."""
        try:
            body = await ex.json_body()
            if not isinstance(body, dict):
                raise bad_request("The request body must be a JSON object.")
            path, request = chat_request(body) if chat else generate_request(body)
            stream = body.get("stream", True) is not False

            async def openai_body() -> tuple[object, bytes]:
                return request, json.dumps(request).encode()

            deliver = partial(_deliver, model=request["model"], chat=chat, stream=stream)
            await self.completions.complete(ex, path, openai_body, deliver)
        except ApiError as e:  # before any agent took it
            await ex.send_json(e.status, {"error": e.message})


async def _deliver(
    ex: Exchange, completion: Completion, *, model: str, chat: bool, stream: bool
) -> None:
    opened = await completion.opened()
    if isinstance(opened, Failed):
        await ex.send_json(opened.error.status, {"error": opened.error.message})
        return
    output = Output(opened.tools)
    started = first = 0  # when the first event came, and the first text (ns)

    def line(text: str, done: bool, **extra: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"model": model, "created_at": _now()}
        if chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["response"] = text
        return {**out, "done": done, **extra}

    async def send_line(data: dict[str, Any]) -> None:
        await ex.send_raw((json.dumps(data) + "\n").encode())

    text = ""
    calls: list[dict[str, Any]] = []
    async for ev in completion:
        if isinstance(ev, Failed):
            if not started:  # nothing was answered yet: its status stands
                await ex.send_json(ev.error.status, {"error": ev.error.message})
            elif stream:
                await send_line({"error": ev.error.message})
                await ex.end()
            else:
                await ex.send_json(500, {"error": ev.error.message})
            return
        if not started:
            started = time.perf_counter_ns()
            if stream:
                await ex.start(200, [(b"content-type", NDJSON.encode())])
        for part in output.parts(unwrap(ev)[1]):  # (one choice)
            if isinstance(part, Call):
                # ollama's calls carry their arguments as an object
                arguments = json.loads(part.arguments)
                calls.append({"function": {"name": part.name, "arguments": arguments}})
                if stream:
                    chunk = line("", False)
                    chunk["message"]["tool_calls"] = calls[-1:]
                    await send_line(chunk)
            elif part.text:
                first = first or time.perf_counter_ns()
                text += part.text
                if stream:
                    await send_line(line(part.text, False))
    end = time.perf_counter_ns()
    done = output.done
    counts = {
        "done_reason": "length" if output.finish == "length" else "stop",
        "total_duration": end - started,
        "load_duration": 0,
        "prompt_eval_count": done.prompt_tokens if done else 0,
        "prompt_eval_duration": (first or end) - started,
        "eval_count": done.completion_tokens if done else 0,
        "eval_duration": end - (first or end),
    }
    if stream:
        await send_line(line("", True, **counts))
        await ex.end()
    else:
        whole = line(text, True, **counts)
        if calls:
            whole["message"]["tool_calls"] = calls
        await ex.send_json(200, whole)


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")
