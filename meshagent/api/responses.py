"""`POST /v1/responses` (OpenAI's Responses API), answered as a chat completion: the request
becomes one (`Completions`: routed, carried to the agent that serves the model, replayed after
a lost stage and metered like any other), and its events become the Responses reply: one
response object, or the Responses event sequence (`response.created`,
`response.output_text.delta`, ..., `response.completed`).

Supported: `input` as text or a list of items (messages with roles user, assistant, system,
developer and text content; `function_call` and `function_call_output` items),
`instructions`, `max_output_tokens`, `temperature`, `top_p`, `stream`, `tools` (functions),
`tool_choice`, `parallel_tool_calls`, `text.format` (text, json_object, json_schema),
`previous_response_id` (the last `KEEP_RESPONSES` responses of this agent are remembered:
`responses_request.py`), `metadata`, `store`, `user`. Function calls come out as
`function_call` output items; the chat completion enforces their arguments and the text
format by grammar. `reasoning` is refused (400 `unsupported_parameter`)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from meshagent.api.completion_events import Completion, Failed, unwrap
from meshagent.api.completions import Completions
from meshagent.api.errors import ApiError
from meshagent.api.exchange import Exchange, Routes
from meshagent.api.replies import Output
from meshagent.api.responses_request import Remembered, ResponsesRequest
from meshagent.api.schemas import parse_body
from meshagent.api.tools import ArgsDelta, Call, CallStart
from meshagent.serving.generation import Finished

CHAT_PATH = "/v1/chat/completions"


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

    def add_call(self, call: Call, item_id: str | None = None) -> dict[str, Any]:
        """A call the model made, as a function_call output item (`item_id`: the one its
        stream announced)."""
        item = {
            "type": "function_call",
            "id": item_id or "fc_" + secrets.token_hex(12),
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }
        self.calls.append(item)
        self.chat_calls.append(call.as_dict())
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


def _usage(done: Finished | None) -> dict[str, Any] | None:
    if done is None:
        return None
    return {
        "input_tokens": done.prompt_tokens,
        "input_tokens_details": {"cached_tokens": done.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": done.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


class ResponsesRoutes:
    """`POST /v1/responses`, answered by the chat completions of `completions`."""

    def __init__(self, completions: Completions, remembered: Remembered | None = None) -> None:
        self.completions = completions
        self.remembered = remembered or Remembered()
        self.routes: Routes = {("POST", "/v1/responses"): self._respond}

    async def _respond(self, ex: Exchange) -> None:
        req: ResponsesRequest = parse_body(ResponsesRequest, await ex.json_body())
        req.refuse_unsupported()
        remembered = self.remembered
        history = remembered.get(req.previous_response_id) if req.previous_response_id else []
        messages = req.messages(history)
        chat: dict[str, Any] = {
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
                chat[ours] = theirs
        reply = _Reply(req)
        # Remembered before the last event goes out: the client may ask on at once.
        reply.on_done = lambda: remembered.put(reply.id, [*messages, reply.conversation_end()])

        async def body() -> tuple[object, bytes]:
            return chat, json.dumps(chat).encode()

        deliver = partial(_deliver, reply=reply, stream=req.stream)
        try:
            await self.completions.complete(ex, CHAT_PATH, body, deliver)
        except ApiError as e:  # before any agent took it
            await ex.send_json(e.status, e.body())


async def _deliver(ex: Exchange, completion: Completion, *, reply: _Reply, stream: bool) -> None:
    opened = await completion.opened()
    if isinstance(opened, Failed):
        await ex.send_json(opened.error.status, opened.error.body())
        return
    output = Output(opened.tools, partial=stream)  # a stream's calls come as they are written
    await (_stream if stream else _whole)(ex, completion, reply, output)


async def _whole(ex: Exchange, completion: Completion, reply: _Reply, output: Output) -> None:
    begun = False
    async for ev in completion:
        if isinstance(ev, Failed):
            err = ev.error
            if not begun:  # the chat reply had not begun: its status stands
                await ex.send_json(err.status, err.body())
            else:  # the chat stream ended in an error: so does this response
                await ex.send_json(500 if err.type == "server_error" else 400, err.body())
            return
        begun = True
        for part in output.parts(unwrap(ev)[1]):  # (one choice)
            if isinstance(part, Call):
                reply.add_call(part)
            else:
                reply.text += part.text
    word = "incomplete" if output.finish == "length" else "completed"
    reply.on_done()
    await ex.send_json(200, reply.body(word, _usage(output.done)))


async def _stream(ex: Exchange, completion: Completion, reply: _Reply, output: Output) -> None:
    part_at = {"output_index": 0, "item_id": reply.item_id, "content_index": 0}
    opened_message = False  # the message item: opened with its first text (or at the end)
    started: dict[str, dict[str, Any]] = {}  # calls streamed as written: where their events go

    async def open_message() -> None:
        nonlocal opened_message
        opened_message = True
        added = reply.item("in_progress")
        await ex.send_event(reply.event("response.output_item.added", output_index=0, item=added))
        empty = {"type": "output_text", "text": "", "annotations": []}
        await ex.send_event(reply.event("response.content_part.added", **part_at, part=empty))

    async for ev in completion:
        if isinstance(ev, Failed):
            err = ev.error
            if not ex.started:  # the chat reply had not begun: its status stands
                await ex.send_json(err.status, err.body())
                return
            await ex.send_event(reply.event("error", message=err.message, code=err.code))
            failure = {"code": err.code or "server_error", "message": err.message}
            failed = reply.body("failed", error=failure)
            await ex.send_event(reply.event("response.failed", response=failed))
            await ex.end()
            return
        if not ex.started:
            await ex.start_sse()
            in_progress = reply.body("in_progress")
            await ex.send_event(reply.event("response.created", response=in_progress))
            await ex.send_event(reply.event("response.in_progress", response=in_progress))
        for part in output.parts(unwrap(ev)[1]):  # (one choice)
            if isinstance(part, CallStart):  # its arguments follow as they are written
                at = {"output_index": len(reply.calls) + opened_message}
                at["item_id"] = "fc_" + secrets.token_hex(12)
                started[part.id] = at
                item = {"type": "function_call", "id": at["item_id"], "call_id": part.id}
                item |= {"name": part.name, "arguments": "", "status": "in_progress"}
                await ex.send_event(
                    reply.event(
                        "response.output_item.added", output_index=at["output_index"], item=item
                    )
                )
            elif isinstance(part, ArgsDelta):
                at = started[next(reversed(started))]
                await ex.send_event(
                    reply.event("response.function_call_arguments.delta", **at, delta=part.text)
                )
            elif isinstance(part, Call):
                at = started.pop(part.id, None)
                if at is None:
                    await _send_call(ex, reply, reply.add_call(part), opened_message)
                else:
                    item = reply.add_call(part, at["item_id"])
                    args = item["arguments"]
                    done = reply.event(
                        "response.function_call_arguments.done", **at, arguments=args
                    )
                    await ex.send_event(done)
                    await ex.send_event(
                        reply.event(
                            "response.output_item.done", output_index=at["output_index"], item=item
                        )
                    )
            elif part.text:
                if not opened_message:
                    await open_message()
                reply.text += part.text
                delta = reply.event(
                    "response.output_text.delta", **part_at, delta=part.text, logprobs=[]
                )
                await ex.send_event(delta)
    if reply.has_message():
        if not opened_message:
            await open_message()
        await ex.send_event(
            reply.event("response.output_text.done", **part_at, text=reply.text, logprobs=[])
        )
        await ex.send_event(reply.event("response.content_part.done", **part_at, part=reply.part()))
        await ex.send_event(
            reply.event("response.output_item.done", output_index=0, item=reply.item("completed"))
        )
    word = "incomplete" if output.finish == "length" else "completed"
    done = reply.body(word, _usage(output.done))
    if not ex.disconnected:  # a response cut short by its client is not one to go on from
        reply.on_done()
    await ex.send_event(reply.event(f"response.{word}", response=done))
    await ex.end()


async def _send_call(ex: Exchange, reply: _Reply, call: dict[str, Any], after: bool) -> None:
    """A function call's events, for a call not streamed as it was written (one whose JSON
    names its function after its arguments): its item, its arguments whole, its end. Calls
    follow the message item, if one was opened (`after`)."""
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
