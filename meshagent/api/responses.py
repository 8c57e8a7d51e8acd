"""`POST /v1/responses` (OpenAI's Responses API), answered by this agent's own chat endpoint:
the request becomes a streamed chat completion run in process (so it is routed, carried to
the agent that serves the model, replayed after a lost stage and metered like any other), and
that stream becomes the Responses reply: one response object, or the Responses event sequence
(`response.created`, `response.output_text.delta`, ..., `response.completed`).

Supported: `input` as text or a list of items (messages with roles user, assistant, system,
developer and text content; `function_call` and `function_call_output` items),
`instructions`, `max_output_tokens`, `temperature`, `top_p`, `stream`, `tools` (functions),
`tool_choice`, `parallel_tool_calls`, `text.format` (text, json_object, json_schema),
`previous_response_id` (the last `KEEP_RESPONSES` responses of this agent are remembered),
`metadata`, `store`, `user`. Function calls come out as `function_call` output items; the
chat endpoint enforces their arguments and the text format by grammar. `reasoning` is
refused (400 `unsupported_parameter`)."""

from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

import trio
from pydantic import BaseModel, ConfigDict, Field

from meshagent.api.errors import bad_request
from meshagent.api.exchange import Exchange
from meshagent.api.inprocess import InnerExchange, error_body, first_status, relay_disconnect
from meshagent.api.schemas import parse_body

KEEP_RESPONSES = 256  # conversations remembered for previous_response_id
CHAT_PATH = "/v1/chat/completions"


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]

    def chat(self) -> dict[str, Any]:
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") not in ("input_text", "output_text", "text"):
                raise bad_request(
                    f"Only text content is supported (not '{part.get('type')}').",
                    param="input",
                    code="unsupported_parameter",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class FunctionCallItem(BaseModel):
    """A call the model made earlier, sent back as input."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str

    def chat(self) -> dict[str, Any]:
        call = {"id": self.call_id, "type": "function"}
        call["function"] = {"name": self.name, "arguments": self.arguments}  # type: ignore[assignment]
        return {"role": "assistant", "content": None, "tool_calls": [call]}


class FunctionOutputItem(BaseModel):
    """What a call returned."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: str
    output: str

    def chat(self) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": self.call_id, "content": self.output}


InputItem = Annotated[
    InputMessage | FunctionCallItem | FunctionOutputItem, Field(discriminator="type")
]


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    user: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    # read only to refuse it: ignoring it would change the answer
    reasoning: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        if self.reasoning:
            raise bad_request(
                "Reasoning options are not supported.",
                param="reasoning",
                code="unsupported_parameter",
            )
        for i, tool in enumerate(self.tools or ()):
            if tool.get("type") != "function":
                raise bad_request(
                    f"Only function tools are supported (not '{tool.get('type')}').",
                    param=f"tools.{i}.type",
                    code="unsupported_parameter",
                )

    def messages(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = list(history)
        if self.instructions:
            out.insert(0, {"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            out.append({"role": "user", "content": self.input})
        else:
            out += [item.chat() for item in self.input]
        return out

    def chat_options(self) -> dict[str, Any]:
        """The tools, tool choice and format, as the chat endpoint takes them."""
        out: dict[str, Any] = {}
        if self.tools:
            out["tools"] = [
                {
                    "type": "function",
                    "function": {k: t[k] for k in ("name", "description", "parameters") if k in t},
                }
                for t in self.tools
            ]
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        if choice is not None:
            out["tool_choice"] = choice
        if self.parallel_tool_calls is not None:
            out["parallel_tool_calls"] = self.parallel_tool_calls
        fmt = (self.text or {}).get("format")
        if fmt and fmt.get("type") == "json_schema":
            spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
            out["response_format"] = {"type": "json_schema", "json_schema": spec}
        elif fmt and fmt.get("type") != "text":
            out["response_format"] = {"type": fmt.get("type")}
        return out


class Remembered:
    """The conversations of recent responses (for `previous_response_id`), oldest dropped."""

    def __init__(self, keep: int = KEEP_RESPONSES) -> None:
        self.keep = keep
        self._by_id: OrderedDict[str, list[dict[str, str]]] = OrderedDict()

    def get(self, response_id: str) -> list[dict[str, str]]:
        try:
            return list(self._by_id[response_id])
        except KeyError:
            raise bad_request(
                f"Previous response '{response_id}' is not known to this agent (it remembers "
                f"the last {self.keep}).",
                param="previous_response_id",
                code="previous_response_not_found",
            ) from None

    def put(self, response_id: str, messages: list[dict[str, str]]) -> None:
        self._by_id[response_id] = messages
        while len(self._by_id) > self.keep:
            self._by_id.popitem(last=False)


class _Reply:
    """The response object as it grows: a message of text, and function calls."""

    def __init__(self, req: ResponsesRequest) -> None:
        self.req = req
        self.id = "resp_" + secrets.token_hex(12)
        self.item_id = "msg_" + secrets.token_hex(12)
        self.created = int(time.time())
        self.text = ""
        self.calls: list[dict[str, Any]] = []  # function_call items
        self.chat_calls: list[dict[str, Any]] = []  # the same, as the chat history has them
        self.seq = 0
        self.on_done: Callable[[], None] = lambda: None  # the output is complete

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def item(self, status: str) -> dict[str, Any]:
        content = [self.part()] if status != "in_progress" else []
        return {
            "type": "message",
            "id": self.item_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def add_call(self, call: dict[str, Any]) -> dict[str, Any]:
        """A call from a chat chunk, as a function_call output item."""
        fn = call["function"]
        item = {
            "type": "function_call",
            "id": "fc_" + secrets.token_hex(12),
            "call_id": call["id"],
            "name": fn["name"],
            "arguments": fn["arguments"],
            "status": "completed",
        }
        self.calls.append(item)
        self.chat_calls.append({k: call[k] for k in ("id", "type", "function")})
        return item

    def has_message(self) -> bool:
        """Whether the output holds a message: text, or nothing else."""
        return bool(self.text) or not self.calls

    def conversation_end(self) -> dict[str, Any]:
        """The assistant's turn, as a later request's history holds it."""
        turn: dict[str, Any] = {"role": "assistant", "content": self.text or None}
        if self.chat_calls:
            turn["tool_calls"] = self.chat_calls
        return turn

    def body(
        self, status: str, usage: dict[str, Any] | None = None, error: dict | None = None
    ) -> dict[str, Any]:
        r = self.req
        done = status in ("completed", "incomplete")
        output = []
        if done:
            output = [self.item("completed")] if self.has_message() else []
            output += self.calls
        fmt = (r.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": r.model,
            "output": output,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "temperature": r.temperature if r.temperature is not None else 1.0,
            "top_p": r.top_p if r.top_p is not None else 1.0,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
            "tools": r.tools or [],
            "text": {"format": fmt},
            "previous_response_id": r.previous_response_id,
            "metadata": r.metadata or {},
            "usage": usage,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
        }


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


async def serve_responses(
    ex: Exchange,
    chat: Callable[[Exchange], Awaitable[None]],
    remembered: Remembered,
) -> None:
    """Answer `ex` (a Responses request) through `chat`, the chat completions endpoint."""
    req: ResponsesRequest = parse_body(ResponsesRequest, await ex.json_body())
    req.refuse_unsupported()
    history = remembered.get(req.previous_response_id) if req.previous_response_id else []
    messages = req.messages(history)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        **req.chat_options(),
    }
    for ours, theirs in (
        ("max_tokens", req.max_output_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
    ):
        if theirs is not None:
            body[ours] = theirs
    reply = _Reply(req)
    # Remembered before the last event goes out: the client may ask on at once.
    reply.on_done = lambda: remembered.put(reply.id, [*messages, reply.conversation_end()])
    send, chunks = trio.open_memory_channel[tuple[str, Any]](64)
    inner = InnerExchange(ex, CHAT_PATH, json.dumps(body).encode(), send)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay_disconnect, ex, inner)
        nursery.start_soon(inner.run, chat)
        if req.stream:
            await _stream(ex, reply, chunks)
        else:
            await _whole(ex, reply, chunks)
        nursery.cancel_scope.cancel()


async def _whole(ex: Exchange, reply: _Reply, chunks: trio.MemoryReceiveChannel) -> None:
    status = await first_status(chunks)
    if status != 200:
        await ex.send_bytes(status, await error_body(chunks), "application/json")
        return
    usage, finish = None, None
    async for kind, data in chunks:
        if kind != "event":
            continue
        if "error" in data:  # the chat stream ended in an error: so does this response
            err = data["error"]
            await ex.send_json(500 if err.get("type") == "server_error" else 400, {"error": err})
            return
        for choice in data.get("choices") or []:
            reply.text += choice["delta"].get("content") or ""
            for call in choice["delta"].get("tool_calls") or ():
                reply.add_call(call)
            finish = choice.get("finish_reason") or finish
        usage = data.get("usage") or usage
    status_word = "incomplete" if finish == "length" else "completed"
    reply.on_done()
    await ex.send_json(200, reply.body(status_word, _usage(usage)))


async def _stream(ex: Exchange, reply: _Reply, chunks: trio.MemoryReceiveChannel) -> None:
    status = await first_status(chunks)
    if status != 200:
        await ex.send_bytes(status, await error_body(chunks), "application/json")
        return
    await ex.start_sse()
    item = {"output_index": 0, "item_id": reply.item_id}
    part = {**item, "content_index": 0}
    await ex.send_event(reply.event("response.created", response=reply.body("in_progress")))
    await ex.send_event(reply.event("response.in_progress", response=reply.body("in_progress")))
    opened = False  # the message item: opened with its first text (or at the end if none)

    async def open_message() -> None:
        nonlocal opened
        opened = True
        added = reply.item("in_progress")
        await ex.send_event(reply.event("response.output_item.added", output_index=0, item=added))
        empty = {"type": "output_text", "text": "", "annotations": []}
        await ex.send_event(reply.event("response.content_part.added", **part, part=empty))

    usage, finish = None, None
    async for kind, data in chunks:
        if kind != "event":
            continue
        if "error" in data:
            err = data["error"]
            await ex.send_event(
                reply.event("error", message=err.get("message"), code=err.get("code"))
            )
            failure = {"code": err.get("code") or "server_error", "message": err.get("message")}
            failed = reply.body("failed", error=failure)
            await ex.send_event(reply.event("response.failed", response=failed))
            await ex.end()
            return
        for choice in data.get("choices") or []:
            delta = choice["delta"].get("content") or ""
            if delta:
                if not opened:
                    await open_message()
                reply.text += delta
                await ex.send_event(
                    reply.event("response.output_text.delta", **part, delta=delta, logprobs=[])
                )
            for call in choice["delta"].get("tool_calls") or ():
                await _send_call(ex, reply, reply.add_call(call), opened)
            finish = choice.get("finish_reason") or finish
        usage = data.get("usage") or usage
    if reply.has_message():
        if not opened:
            await open_message()
        await ex.send_event(
            reply.event("response.output_text.done", **part, text=reply.text, logprobs=[])
        )
        await ex.send_event(reply.event("response.content_part.done", **part, part=reply.part()))
        await ex.send_event(
            reply.event("response.output_item.done", output_index=0, item=reply.item("completed"))
        )
    word = "incomplete" if finish == "length" else "completed"
    done = reply.body(word, _usage(usage))
    if not ex.disconnected:  # a response cut short by its client is not one to go on from
        reply.on_done()
    await ex.send_event(reply.event(f"response.{word}", response=done))
    await ex.end()


async def _send_call(ex: Exchange, reply: _Reply, call: dict[str, Any], after: bool) -> None:
    """A function call's events: its item, its arguments (whole: the chat endpoint passes a
    call on once its JSON is complete), its end. Calls follow the message item, if one was
    opened (`after`)."""
    at = {"output_index": len(reply.calls) - 1 + after, "item_id": call["id"]}
    await ex.send_event(
        reply.event(
            "response.output_item.added",
            output_index=at["output_index"],
            item={**call, "arguments": "", "status": "in_progress"},
        )
    )
    args = call["arguments"]
    await ex.send_event(reply.event("response.function_call_arguments.delta", **at, delta=args))
    await ex.send_event(reply.event("response.function_call_arguments.done", **at, arguments=args))
    await ex.send_event(
        reply.event("response.output_item.done", output_index=at["output_index"], item=call)
    )
