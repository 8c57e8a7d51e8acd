"""Ollama's endpoints, for tools that speak only its protocol: `GET /api/tags`, `POST
/api/chat` and `POST /api/generate`, answered by this agent's own chat and completion
endpoints run in process (`api/inprocess.py`: routed, carried, replayed and metered like any
request). Streams are newline-delimited JSON, as ollama's are, and stream by default.

Options read: `temperature`, `top_p`, `num_predict`, `seed`, `stop`, `presence_penalty`,
`frequency_penalty`. `format` (JSON or a schema), tools and images are refused with 400:
their output would not be constrained or read. Errors are ollama's shape, `{"error": "..."}`."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import trio

from meshagent.api.errors import ApiError, bad_request
from meshagent.api.exchange import Exchange
from meshagent.api.inprocess import InnerExchange, error_body, first_status, relay_disconnect

Handler = Callable[[Exchange], Awaitable[None]]
NDJSON = "application/x-ndjson"
_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "num_predict": "max_tokens",
    "seed": "seed",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}


def model_name(name: Any) -> str:
    """Ollama's names carry a tag (`:latest` when none is given); ours have none."""
    if not isinstance(name, str) or not name:
        raise bad_request("Missing required parameter: 'model'.", param="model")
    return name.removesuffix(":latest")


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
                "digest": "",
                "details": {
                    "format": "gguf",
                    "family": info.get("architecture", ""),
                    "parameter_size": "",
                    "quantization_level": "",
                },
            }
        )
    return {"models": out}


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
    for theirs, ours in _OPTIONS.items():
        if options.get(theirs) is not None:
            out[ours] = options[theirs]
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
    if body.get("raw"):
        out["prompt"] = prompt
        return "/v1/completions", out
    system = body.get("system")
    out["messages"] = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    return "/v1/chat/completions", out


async def serve(ex: Exchange, handler: Handler, *, chat: bool) -> None:
    """Answer `ex` (`/api/chat` when `chat`, else `/api/generate`) through `handler`."""
    try:
        body = await ex.json_body()
        if not isinstance(body, dict):
            raise bad_request("The request body must be a JSON object.")
        path, request = chat_request(body) if chat else generate_request(body)
    except ApiError as e:
        await ex.send_json(e.status, {"error": e.message})
        return
    stream = body.get("stream", True) is not False
    send, chunks = trio.open_memory_channel[tuple[str, Any]](64)
    inner = InnerExchange(ex, path, json.dumps(request).encode(), send)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay_disconnect, ex, inner)
        nursery.start_soon(inner.run, handler)
        await _answer(ex, chunks, request["model"], chat=chat, stream=stream)
        nursery.cancel_scope.cancel()


async def _answer(
    ex: Exchange, chunks: trio.MemoryReceiveChannel, model: str, *, chat: bool, stream: bool
) -> None:
    status = await first_status(chunks)
    if status != 200:
        raw = await error_body(chunks)
        try:
            message = json.loads(raw)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = raw.decode(errors="replace")
        await ex.send_json(status, {"error": message})
        return
    started = time.perf_counter_ns()
    first: int | None = None

    def line(text: str, done: bool, **extra: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"model": model, "created_at": _now()}
        if chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["response"] = text
        return {**out, "done": done, **extra}

    if stream:
        await ex.start(200, [(b"content-type", NDJSON.encode())])
    text, usage, finish = "", None, None
    calls: list[dict[str, Any]] = []
    async for kind, data in chunks:
        if kind != "event":
            continue
        if "error" in data:
            message = (data["error"] or {}).get("message", "the request failed")
            if stream:
                await ex.send_raw((json.dumps({"error": message}) + "\n").encode())
                await ex.end()
            else:
                await ex.send_json(500, {"error": message})
            return
        for choice in data.get("choices") or []:
            # a chat chunk's delta (also for /api/generate through the template), or the
            # text of a completion chunk (a raw prompt)
            piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            if piece:
                first = first or time.perf_counter_ns()
                text += piece
                if stream:
                    await ex.send_raw((json.dumps(line(piece, False)) + "\n").encode())
            for call in (choice.get("delta") or {}).get("tool_calls") or ():
                fn = call["function"]
                calls.append(
                    {"function": {"name": fn["name"], "arguments": json.loads(fn["arguments"])}}
                )
                if stream:
                    chunk = line("", False)
                    chunk["message"]["tool_calls"] = calls[-1:]
                    await ex.send_raw((json.dumps(chunk) + "\n").encode())
            finish = choice.get("finish_reason") or finish
        usage = data.get("usage") or usage
    end = time.perf_counter_ns()
    usage = usage or {}
    counts = {
        "done_reason": "length" if finish == "length" else "stop",
        "total_duration": end - started,
        "load_duration": 0,
        "prompt_eval_count": usage.get("prompt_tokens", 0),
        "prompt_eval_duration": (first or end) - started,
        "eval_count": usage.get("completion_tokens", 0),
        "eval_duration": end - (first or end),
    }
    if stream:
        await ex.send_raw((json.dumps(line("", True, **counts)) + "\n").encode())
        await ex.end()
    else:
        whole = line(text, True, **counts)
        if calls:
            whole["message"]["tool_calls"] = calls
        await ex.send_json(200, whole)


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")
