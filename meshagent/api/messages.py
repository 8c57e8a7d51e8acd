"""`POST /v1/messages` (Anthropic's Messages API) and `POST /v1/messages/count_tokens`,
answered as chat completions: the request becomes one (`messages_request.py`; routed, carried
to the agent that serves the model, replayed after a lost stage and metered like any other),
and its events become Anthropic's reply: one message object, or its event stream
(`message_start`, `ping`, `content_block_start` / `content_block_delta` / `content_block_stop`
per text or `tool_use` block, `message_delta` with the stop reason and usage, `message_stop`).
Errors take Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`."""

from __future__ import annotations

import json
import secrets
from functools import partial
from typing import Any

from meshagent.api.completion_events import Completion, Failed, unwrap
from meshagent.api.completions import Completions
from meshagent.api.errors import ApiError
from meshagent.api.exchange import Exchange, Routes
from meshagent.api.messages_request import MessagesRequest
from meshagent.api.replies import Output
from meshagent.api.responses import CHAT_PATH
from meshagent.api.schemas import parse_body
from meshagent.api.tools import ArgsDelta, Call, CallStart, Text
from meshagent.serving.generation import Finished

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(err: ApiError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(err.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def _stop_reason(finish: str | None, done: Finished | None) -> tuple[str, str | None]:
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if done is not None and done.stop is not None:
        return "stop_sequence", done.stop
    return "end_turn", None


def _usage(done: Finished | None) -> dict[str, Any]:
    prompt = done.prompt_tokens if done else 0
    cached = done.cached_tokens if done else 0
    return {
        "input_tokens": prompt - cached,  # Anthropic counts what the cache gave apart
        "output_tokens": done.completion_tokens if done else 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class _Message:
    """The message as it grows: content blocks in order."""

    def __init__(self, model: str) -> None:
        self.id = "msg_" + secrets.token_hex(12)
        self.model = model
        self.content: list[dict[str, Any]] = []

    def add_text(self, text: str) -> None:
        if self.content and self.content[-1]["type"] == "text":
            self.content[-1]["text"] += text
        else:
            self.content.append({"type": "text", "text": text})

    def add_call(self, call: Call) -> None:
        self.content.append(
            {
                "type": "tool_use",
                "id": _tool_id(call.id),
                "name": call.name,
                "input": json.loads(call.arguments),
            }
        )

    def body(self, output: Output) -> dict[str, Any]:
        reason, sequence = _stop_reason(output.finish, output.done)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": _usage(output.done),
        }


class MessagesRoutes:
    """Anthropic's Messages API, answered by the chat completions of `completions`."""

    def __init__(self, completions: Completions) -> None:
        self.completions = completions
        self.routes: Routes = {
            ("POST", "/v1/messages"): self._messages,
            ("POST", "/v1/messages/count_tokens"): self._count_tokens,
        }

    async def _chat(self, ex: Exchange, count: bool) -> tuple[MessagesRequest, dict] | None:
        try:
            body = await ex.json_body()
            if count and isinstance(body, dict):
                body = {"max_tokens": 1, **body}  # (count_tokens has none)
            req: MessagesRequest = parse_body(MessagesRequest, body)
            req.refuse_unsupported()
            chat: dict[str, Any] = {
                "model": req.model,
                "messages": req.chat_messages(),
                "stream": True,
                "stream_options": {"include_usage": True},
                **req.chat_options(),
            }
        except ApiError as e:
            await ex.send_json(e.status, error_body(e))
            return None
        return req, chat

    async def _messages(self, ex: Exchange) -> None:
        got = await self._chat(ex, count=False)
        if got is None:
            return
        req, chat = got

        async def body() -> tuple[object, bytes]:
            return chat, json.dumps(chat).encode()

        deliver = partial(_deliver, message=_Message(req.model), stream=req.stream)
        try:
            await self.completions.complete(ex, CHAT_PATH, body, deliver, sse=req.stream)
        except ApiError as e:  # before any agent took it
            await _fail(ex, e)

    async def _count_tokens(self, ex: Exchange) -> None:
        """The prompt's tokens as the model's chat template renders it: the request runs as a
        completion of one token, whose usage counts its prompt (a kept prefix makes a repeated
        count cheap)."""
        got = await self._chat(ex, count=True)
        if got is None:
            return
        _, chat = got
        chat = {**chat, "max_tokens": 1, "temperature": 0}
        chat.pop("stop", None)

        async def body() -> tuple[object, bytes]:
            return chat, json.dumps(chat).encode()

        try:
            await self.completions.complete(ex, CHAT_PATH, body, _deliver_count)
        except ApiError as e:
            await ex.send_json(e.status, error_body(e))


async def _fail(ex: Exchange, err: ApiError) -> None:
    if not ex.started:
        await ex.send_json(err.status, error_body(err))
        return
    await _event(ex, "error", error_body(err))
    await ex.end()


async def _event(ex: Exchange, name: str, payload: dict[str, Any]) -> None:
    await ex.send_named_event(name, {"type": name, **payload} if name != "error" else payload)


async def _deliver_count(ex: Exchange, completion: Completion) -> None:
    opened = await completion.opened()
    if isinstance(opened, Failed):
        await ex.send_json(opened.error.status, error_body(opened.error))
        return
    async for ev in completion:
        if isinstance(ev, Failed):
            await ex.send_json(ev.error.status, error_body(ev.error))
            return
        _, event = unwrap(ev)
        if isinstance(event, Finished):
            await ex.send_json(200, {"input_tokens": event.prompt_tokens})
            return


async def _deliver(
    ex: Exchange, completion: Completion, *, message: _Message, stream: bool
) -> None:
    opened = await completion.opened()
    if isinstance(opened, Failed):
        await _fail(ex, opened.error)
        return
    if not stream:
        await _whole(ex, completion, message, Output(opened.tools))
    else:
        await _stream(ex, completion, message, Output(opened.tools, partial=True))


async def _whole(ex: Exchange, completion: Completion, message: _Message, output: Output) -> None:
    async for ev in completion:
        if isinstance(ev, Failed):
            await _fail(ex, ev.error)
            return
        for part in output.parts(unwrap(ev)[1]):
            if isinstance(part, Call):
                message.add_call(part)
            elif isinstance(part, Text) and part.text:
                message.add_text(part.text)
    await ex.send_json(200, message.body(output))


async def _stream(ex: Exchange, completion: Completion, message: _Message, output: Output) -> None:
    blocks = 0  # content blocks opened so far
    open_kind: str | None = None  # the kind of the block open now: "text" or "tool_use"
    streamed: set[str] = set()  # calls whose start went as it was written
    begun = False  # message_start sent

    async def close_block() -> None:
        nonlocal open_kind
        if open_kind is not None:
            await _event(ex, "content_block_stop", {"index": blocks - 1})
            open_kind = None

    async def open_block(block: dict[str, Any]) -> None:
        nonlocal blocks, open_kind
        await close_block()
        await _event(ex, "content_block_start", {"index": blocks, "content_block": block})
        blocks += 1
        open_kind = block["type"]

    async def delta(payload: dict[str, Any]) -> None:
        await _event(ex, "content_block_delta", {"index": blocks - 1, "delta": payload})

    async for ev in completion:
        if isinstance(ev, Failed):
            await _fail(ex, ev.error)
            return
        if not ex.started:
            await ex.start_sse()
        if not begun:
            begun = True
            start = {**message.body(output), "content": [], "stop_reason": None}
            await _event(ex, "message_start", {"message": start})
            await _event(ex, "ping", {})
        for part in output.parts(unwrap(ev)[1]):
            if isinstance(part, CallStart):
                streamed.add(part.id)
                tool = {"type": "tool_use", "id": _tool_id(part.id), "name": part.name, "input": {}}
                await open_block(tool)
            elif isinstance(part, ArgsDelta):
                await delta({"type": "input_json_delta", "partial_json": part.text})
            elif isinstance(part, Call):
                if part.id not in streamed:
                    tool = {"type": "tool_use", "id": _tool_id(part.id), "name": part.name}
                    await open_block({**tool, "input": {}})
                    await delta({"type": "input_json_delta", "partial_json": part.arguments})
                message.add_call(part)
                await close_block()
            elif part.text:
                if open_kind != "text":
                    await open_block({"type": "text", "text": ""})
                message.add_text(part.text)
                await delta({"type": "text_delta", "text": part.text})
    await close_block()
    reason, sequence = _stop_reason(output.finish, output.done)
    await _event(
        ex,
        "message_delta",
        {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": _usage(output.done)},
    )
    await _event(ex, "message_stop", {})
    await ex.end()
