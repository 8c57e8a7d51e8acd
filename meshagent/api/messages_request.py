"""Anthropic's Messages API request (`POST /v1/messages`) as a chat completion's: the system
prompt and the turns (text, `tool_use` and `tool_result` blocks) as chat messages, the tools as
functions, `tool_choice` and the sampling options as the chat request's. Whatever the API has
that meshagent cannot honour (images, documents, server tools) is refused by name; extended
thinking is accepted and produces no thinking blocks (clients such as Claude Code ask for it
of every model they may)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from meshagent.api.errors import ApiError, bad_request


def unsupported(param: str, what: str) -> ApiError:
    return bad_request(f"{what} is not supported.", param=param, code="unsupported_parameter")


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # client tools have none (or "custom"); server tools are refused

    def function(self) -> dict[str, Any]:
        fn = {"name": self.name, "description": self.description or ""}
        return {"type": "function", "function": {**fn, "parameters": self.input_schema}}


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessageTurn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1)]
    messages: list[MessageTurn] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # accepted; no thinking blocks come back
    output_config: dict[str, Any] | None = None  # `format`: a JSON schema the reply follows
    service_tier: str | None = None

    def refuse_unsupported(self) -> None:
        for i, tool in enumerate(self.tools or ()):
            if tool.type not in (None, "custom"):
                raise unsupported(f"tools.{i}.type", f"The server tool '{tool.type}'")

    def chat_messages(self) -> list[dict[str, Any]]:
        """The system prompt and turns as chat messages (a turn's tool results become tool
        messages, its calls an assistant's `tool_calls`)."""
        out: list[dict[str, Any]] = []
        if self.system:
            out.append({"role": "system", "content": _system_text(self.system)})
        for i, turn in enumerate(self.messages):
            out += _turn(turn, f"messages.{i}.content")
        return out

    def chat_options(self) -> dict[str, Any]:
        """The chat request's fields for the rest of the request."""
        chat: dict[str, Any] = {"max_tokens": self.max_tokens}
        # Anthropic's temperature runs 0-1 with 1 its default, as OpenAI's does at 1.
        if self.temperature is not None:
            chat["temperature"] = self.temperature
        if self.top_p is not None:
            chat["top_p"] = self.top_p
        if self.top_k is not None:
            chat["meshagent"] = {"top_k": self.top_k}
        if self.stop_sequences:
            chat["stop"] = self.stop_sequences
        fmt = (self.output_config or {}).get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
                raise bad_request(
                    "output_config.format must be {'type': 'json_schema', 'schema': {...}}.",
                    param="output_config.format",
                )
            schema = {"name": "output", "schema": fmt.get("schema"), "strict": True}
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
        if self.tools:
            chat["tools"] = [t.function() for t in self.tools]
            choice = self.tool_choice or ToolChoice(type="auto")
            if choice.type == "tool":
                if not choice.name:
                    raise bad_request("tool_choice of type 'tool' names one.", param="tool_choice")
                chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[
                    choice.type
                ]
            if choice.disable_parallel_tool_use:
                chat["parallel_tool_calls"] = False
        elif self.tool_choice is not None and self.tool_choice.type in ("any", "tool"):
            raise bad_request("tool_choice needs tools.", param="tool_choice")
        return chat


def _system_text(system: str | list[dict[str, Any]]) -> str:
    if isinstance(system, str):
        return system
    return "\n".join(_text_block(b, f"system.{i}") for i, b in enumerate(system))


def _text_block(block: dict[str, Any], param: str) -> str:
    if block.get("type") != "text":
        raise unsupported(param, f"A '{block.get('type')}' block here")
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request("A text block needs 'text'.", param=param)
    return text


def _turn(turn: MessageTurn, param: str) -> list[dict[str, Any]]:
    if isinstance(turn.content, str):
        return [{"role": turn.role, "content": turn.content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for i, block in enumerate(turn.content):
        kind = block.get("type")
        where = f"{param}.{i}"
        if kind == "text":
            texts.append(_text_block(block, where))
        elif kind == "tool_use" and turn.role == "assistant":
            name, ident = block.get("name"), block.get("id")
            if not isinstance(name, str) or not isinstance(ident, str):
                raise bad_request("A tool_use block needs 'id' and 'name'.", param=where)
            args = json.dumps(block.get("input", {}), ensure_ascii=False)
            fn = {"name": name, "arguments": args}
            calls.append({"id": ident, "type": "function", "function": fn})
        elif kind == "tool_result" and turn.role == "user":
            ident = block.get("tool_use_id")
            if not isinstance(ident, str):
                raise bad_request("A tool_result block needs 'tool_use_id'.", param=where)
            content = block.get("content", "")
            if isinstance(content, list):
                content = "\n".join(
                    _text_block(b, f"{where}.content.{j}") for j, b in enumerate(content)
                )
            elif not isinstance(content, str):
                raise bad_request("A tool_result's content is text.", param=f"{where}.content")
            if block.get("is_error"):
                content = f"Error: {content}"
            results.append({"role": "tool", "tool_call_id": ident, "content": content})
        elif kind in ("thinking", "redacted_thinking") and turn.role == "assistant":
            continue  # earlier reasoning is not replayed
        else:
            raise unsupported(where, f"A '{kind}' block in a {turn.role} turn")
    text = "".join(texts)
    if turn.role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    out = list(results)
    if text or not results:
        out.append({"role": "user", "content": text})
    return out
